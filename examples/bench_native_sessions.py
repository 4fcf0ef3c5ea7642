"""Several characters answering at once on the native host: their turns sharing decode steps against one at a time.

Each round starts one process per mode (their order alternates between rounds): `shared` opens the host with
`sessions_per_step` = the number of sessions, `single` with 1. Each creates the sessions (one system prompt per
character), has every character say a short first turn, then submits one turn per character at once and times
them from the first submit to the last answer's end. The figure is the median over rounds of shared / single
answered tokens per second, with each mode's medians and spread. Both modes must give every character the same
tokens (greedy; each answer is the one a fresh prefill of that character's history gives). `--plans` runs both on
the simulated device: then `--plans` is the file made with `pipeshard plan --batch N` for the shared mode and
`--single-plans` the `--batch 1` one.

    make host
    python examples/bench_native_sessions.py PACK --sessions 4 --rounds 5 --new-tokens 64 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHARACTERS = [
    "You are a pirate captain.",
    "You are a village blacksmith.",
    "You are a court wizard.",
    "You are a tavern keeper.",
    "You are a city guard.",
    "You are a travelling merchant.",
    "You are a royal cook.",
    "You are a forest ranger.",
]
FIRST_TURN = "Hello! Who are you?"
TIMED_TURN = "Tell me a long story about the strangest day of your life, with many details."
MODES = ("shared", "single")


def _extensions_library() -> Path:
    from pipeshard.peers import NATIVE_HOST_BUILD

    found = sorted((NATIVE_HOST_BUILD / "deps").rglob("libortextensions.so"))
    if not found:
        raise SystemExit("error: no libortextensions.so under build/native-host/deps: run make host")
    return found[0]


def _worker(args: argparse.Namespace) -> dict:
    from pipeshard.peers import HOST_TOKEN_CALLBACK, HostOptions, HostSampling, native_host_library

    library = ctypes.CDLL(str(native_host_library()))
    library.pipeshard_last_error.restype = ctypes.c_char_p
    library.pipeshard_report.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
    options = HostOptions()
    library.pipeshard_default_options(ctypes.byref(options))
    options.threads = args.threads
    options.extensions_library = str(_extensions_library()).encode()
    options.sessions_per_step = args.sessions if args.worker == "shared" else 1
    plans = args.plans if args.worker == "shared" else args.single_plans
    if plans:
        options.plans_path, options.device = plans.encode(), b"sim"
    host = ctypes.c_void_p()

    def check(status: int) -> None:
        if status != 0:
            raise SystemExit(f"error: {library.pipeshard_last_error(host).decode()}")

    check(library.pipeshard_open(args.pack.encode(), ctypes.byref(options), ctypes.byref(host)))
    sessions = []
    for character in CHARACTERS[: args.sessions]:
        session = ctypes.c_void_p()
        check(library.pipeshard_session_create(host, character.encode(), ctypes.byref(session)))
        sessions.append(session)
    answers: list[list[int]] = [[] for _ in sessions]
    ended_at = [0.0] * len(sessions)

    def on_token(token: int, _piece: bytes, user_data) -> int:
        index = user_data or 0
        if token >= 0:
            answers[index].append(int(token))
        ended_at[index] = time.perf_counter()
        return 0

    callback = HOST_TOKEN_CALLBACK(on_token)

    def turns(user: str, new_tokens: int) -> float:
        sampling = HostSampling()
        library.pipeshard_default_sampling(ctypes.byref(sampling))
        sampling.max_new_tokens = new_tokens
        for answer in answers:
            answer.clear()
        requests = []
        started = time.perf_counter()
        for index, session in enumerate(sessions):
            request = ctypes.c_uint64()
            check(
                library.pipeshard_submit(
                    host,
                    session,
                    user.encode(),
                    ctypes.byref(sampling),
                    callback,
                    None,
                    ctypes.c_void_p(index),
                    ctypes.byref(request),
                )
            )
            requests.append(request.value)
        for request in requests:
            check(library.pipeshard_wait(host, ctypes.c_uint64(request), -1))
        return max(ended_at) - started

    turns(FIRST_TURN, args.warmup_tokens)
    seconds = turns(TIMED_TURN, args.new_tokens)
    report = ctypes.create_string_buffer(1 << 16)
    check(library.pipeshard_report(host, report, len(report), None))
    library.pipeshard_close(host)
    answered = sum(len(answer) for answer in answers)
    return {
        "answers": answers,
        "seconds": seconds,
        "tok_s": answered / seconds,
        "shared_steps": json.loads(report.value)["shared_steps"],
    }


def _run_worker(args: argparse.Namespace, mode: str) -> dict:
    command = [
        sys.executable,
        *(["-P"] if sys.flags.safe_path else []),
        __file__,
        args.pack,
        "--worker",
        mode,
    ]
    command += ["--sessions", str(args.sessions), "--threads", str(args.threads)]
    command += ["--new-tokens", str(args.new_tokens), "--warmup-tokens", str(args.warmup_tokens)]
    command += ["--plans", args.plans] if args.plans else []
    command += ["--single-plans", args.single_plans] if args.single_plans else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {mode} worker failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pack")
    parser.add_argument("--sessions", type=int, default=4, choices=range(2, len(CHARACTERS) + 1))
    parser.add_argument("--plans", help="plans made with --batch SESSIONS: the shared mode runs them on sim")
    parser.add_argument("--single-plans", help="plans made with --batch 1: the single mode runs them on sim")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the rounds and figures here")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if bool(args.plans) != bool(args.single_plans):
        raise SystemExit("error: --plans and --single-plans go together (the batch-N and the batch-1 plans)")
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    rounds = []
    for index in range(args.rounds):
        order = MODES if index % 2 == 0 else MODES[::-1]
        measured = {mode: _run_worker(args, mode) for mode in order}
        if measured["shared"]["answers"] != measured["single"]["answers"]:
            raise SystemExit(f"error: round {index}: the shared steps' answers differ from the single ones'")
        if measured["shared"]["shared_steps"] == 0:
            raise SystemExit(f"error: round {index}: no decode step was shared")
        rates = {mode: measured[mode]["tok_s"] for mode in MODES}
        rounds.append({"order": list(order), **rates, "ratio": rates["shared"] / rates["single"]})
        print(
            f"round {index}: shared {rates['shared']:.2f} tok/s, single {rates['single']:.2f} tok/s, "
            f"ratio {rounds[-1]['ratio']:.3f} ({order[0]} first)",
            flush=True,
        )
    summary = {
        "sessions": args.sessions,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "plans": args.plans,
        "answered_tokens": sum(len(answer) for answer in measured["shared"]["answers"]),
        "rounds": rounds,
    }
    for key in (*MODES, "ratio"):
        values = [r[key] for r in rounds]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(f"{key}: median {summary[key]['median']:.3f} (min {min(values):.3f}, max {max(values):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
