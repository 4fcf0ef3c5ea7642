/* pipeshard native host: run a pipeshard model pack with its saved plans through ONNX Runtime's C API alone.
 *
 * A C ABI over a C++17 library, for game engines (Unreal from C++, Unity from C# through PipeshardHost.cs).
 * Every function returns a status; on failure pipeshard_last_error(host) holds one line saying what went wrong
 * (pipeshard_last_error(NULL) for a failed pipeshard_open). No function throws or aborts on bad input.
 *
 * Threads: a host owns one worker thread, which runs every request in the order submitted, and every callback
 * (token, done) is called on that worker thread. Every function may be called from any thread; the blocking ones
 * (pipeshard_generate*, pipeshard_session_say, _rollback, _save, pipeshard_release, pipeshard_warmup) queue their work
 * on the worker and wait for it, so they fail with PIPESHARD_ERR_ARGUMENT when called from a callback.
 * pipeshard_cancel, pipeshard_set_vram_budget and pipeshard_set_free_vram take effect between two sub-layer runs or
 * two steps of the request running. pipeshard_last_error is kept per calling thread: read it on the thread whose
 * call failed, before its next call; a request's own failure reaches its on_done. See docs/native-host.md. */
#ifndef PIPESHARD_HOST_H
#define PIPESHARD_HOST_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(PIPESHARD_HOST_BUILD)
#define PIPESHARD_HOST_API __declspec(dllexport)
#else
#define PIPESHARD_HOST_API __declspec(dllimport)
#endif
#else
#define PIPESHARD_HOST_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define PIPESHARD_HOST_ABI_VERSION 3

typedef enum pipeshard_status {
    PIPESHARD_OK = 0,
    PIPESHARD_ERR_ARGUMENT = 1, /* a null pointer, a bad option or sampling value, a buffer too small */
    PIPESHARD_ERR_PACK = 2,     /* the pack is missing, corrupt, of another schema, or needs a newer ONNX Runtime */
    PIPESHARD_ERR_PLANS = 3,    /* the plans file is unreadable, of another schema, or made for another pack */
    PIPESHARD_ERR_BUDGET = 4,   /* a VRAM budget below every rung of the plans file's ladder */
    PIPESHARD_ERR_DEVICE = 5,   /* the device asked for is not usable here (no CUDA EP, no GPU) */
    PIPESHARD_ERR_CONTEXT = 6,  /* the prompt and max_new_tokens do not fit the KV cache's context */
    PIPESHARD_ERR_RUNTIME = 7,  /* ONNX Runtime failed while running (its message follows) */
    PIPESHARD_ERR_CANCELLED = 8 /* the request was cancelled (pipeshard_cancel) before it ended */
} pipeshard_status;

typedef struct pipeshard_host pipeshard_host;
typedef struct pipeshard_session pipeshard_session;
typedef uint64_t pipeshard_request_id;

/* How the VRAM budget is found: a fixed number of bytes, or what the device has free minus a reserve the game
 * keeps for itself, followed between steps (cudaMemGetInfo on cuda; pipeshard_set_free_vram's figure otherwise). */
typedef enum pipeshard_budget_mode { PIPESHARD_BUDGET_FIXED = 0, PIPESHARD_BUDGET_AUTO = 1 } pipeshard_budget_mode;

typedef struct pipeshard_options {
    int abi_version;                /* PIPESHARD_HOST_ABI_VERSION (set by pipeshard_default_options) */
    const char* plans_path;         /* a plans.json of `pipeshard plan PACK --out`, or NULL: every unit on the CPU */
    const char* device;             /* "cpu" (the default; only with no plans), "sim" or "cuda" */
    const char* extensions_library; /* path of libortextensions (tokenizer ops); NULL: no text, token ids only */
    int threads;                    /* cap on the CPU threads of ONNX Runtime's intra-op pool; 0: all cores */
    int context;                    /* KV capacity in tokens; 0: the plans file's, else min(4096, the model's) */
    uint64_t vram_budget_bytes;     /* FIXED: the budget; 0: the largest rung of the plans file's ladder */
    int budget_mode;                /* a pipeshard_budget_mode; FIXED by default */
    uint64_t vram_reserve_bytes;    /* AUTO: device memory left free for the game */
    int prefill_chunk_tokens;       /* a prompt is fed in steps of at most this many tokens (cancel acts between
                                       them); 0: the plans' largest tier, or 64 without plans */
    int sessions_per_step;          /* sequences of the KV cache: turns of up to this many sessions, submitted
                                       together, share their decode steps (1 to 16; a plans file made with --batch
                                       of it); 0: 1 */
} pipeshard_options;

typedef struct pipeshard_sampling {
    int max_new_tokens;        /* >= 1; default 64 */
    float temperature;         /* 0: greedy (the default) */
    int top_k;                 /* 0: off */
    float top_p;               /* in (0, 1]; 1: off */
    float repetition_penalty;  /* > 0; 1: off */
    uint64_t seed;             /* for temperature > 0 */
    int use_chat_template;     /* 1 (default): the prompt is one user turn of the pack's pre-rendered template */
    const char* system_prompt; /* with the chat template; NULL: the template's default */
    const char* const* stop_strings; /* generation ends before the first of these in the answer's text */
    size_t stop_string_count;
} pipeshard_sampling;

/* A conversation's message, for pipeshard_render_chat: role "system", "user" or "assistant". */
typedef struct pipeshard_message {
    const char* role;
    const char* content;
} pipeshard_message;

/* An image for a VLM pack's prompt: 8-bit RGB pixels, `height` rows of `width` pixels of 3 bytes (R, G, B), top row
 * first, no padding between rows (what a texture read back as RGB8 gives). The host preprocesses it as the Python
 * engine does (runtime/images.py: Pillow's resize, tiling, rescale, normalize). */
typedef struct pipeshard_image {
    const uint8_t* rgb;
    int width;  /* 1 to 32768 */
    int height; /* 1 to 32768 */
} pipeshard_image;

/* Called once per generated token with its id and the text it completes (UTF-8, maybe empty while a multi-byte
 * character is incomplete or the text could still begin a stop string; empty without an extensions library), on
 * the worker thread. Return nonzero to stop generating. With stop strings, a last call with token_id -1 hands on
 * the text held back when no stop string came. */
typedef int (*pipeshard_token_callback)(int64_t token_id, const char* text_piece, void* user_data);

/* Called once when a request ends, on the worker thread: PIPESHARD_OK (end of sequence, max_new_tokens, a stop
 * string, or the token callback asked to stop), PIPESHARD_ERR_CANCELLED, or another error with its message.
 * `text` is the answer's text so far. */
typedef void (*pipeshard_done_callback)(pipeshard_request_id request, pipeshard_status status, const char* text,
                                        const char* message, void* user_data);

/* Called once per whole sentence of the answer, for speech, on the worker thread, after the token callback of the
 * token that completed it: text up to and including . ! ? or … followed by whitespace, or up to and including a
 * newline (whitespace after a sentence begins the next one; a run of only whitespace joins the next sentence). When
 * the request ends with PIPESHARD_OK, the text after the last whole sentence comes last (when not empty), before
 * on_done: the sentences joined are the answer's text. A cancelled or failed request hands on no remainder. Needs
 * the extensions library (text). */
typedef void (*pipeshard_sentence_callback)(pipeshard_request_id request, const char* sentence, void* user_data);

PIPESHARD_HOST_API void pipeshard_default_options(pipeshard_options* options);
PIPESHARD_HOST_API void pipeshard_default_sampling(pipeshard_sampling* sampling);

/* Open the pack folder: check its manifest (and the plans file against it), create the sessions, size the KV. */
PIPESHARD_HOST_API pipeshard_status pipeshard_open(const char* pack_dir, const pipeshard_options* options,
                                                   pipeshard_host** out_host);

/* Generate from text (tokenized by the pack's tokenizer.onnx) or from token ids, and wait for the answer; the
 * callback runs on the worker thread while the caller waits. The KV cache starts empty. */
PIPESHARD_HOST_API pipeshard_status pipeshard_generate(pipeshard_host* host, const char* prompt,
                                                       const pipeshard_sampling* sampling,
                                                       pipeshard_token_callback callback, void* user_data);
PIPESHARD_HOST_API pipeshard_status pipeshard_generate_ids(pipeshard_host* host, const int64_t* prompt_ids,
                                                           size_t prompt_length, const pipeshard_sampling* sampling,
                                                           pipeshard_token_callback callback, void* user_data);

/* A one-shot prompt with images, for a VLM pack (SmolVLM / Idefics3, llava-style towers): image i goes where the
 * prompt's i-th image placeholder is ("<image>"), or all before its text when it has none; the images are encoded
 * on the CPU and their features take the image tokens' places as the prompt is fed. The pixels are read before this
 * returns (pipeshard_submit_with_images: copied before it returns). image_count 0: as pipeshard_generate. A text
 * pack, NULL pixels, a size out of range, or placeholders that do not match the images: PIPESHARD_ERR_ARGUMENT. */
PIPESHARD_HOST_API pipeshard_status pipeshard_generate_with_images(pipeshard_host* host, const char* prompt,
                                                                   const pipeshard_image* images, size_t image_count,
                                                                   const pipeshard_sampling* sampling,
                                                                   pipeshard_token_callback callback, void* user_data);

/* Queue a generation and return at once with its id; tokens go to `on_token` and the end to `on_done` (both may be
 * NULL), on the worker thread. `session` NULL: a one-shot prompt (the KV starts empty); else `prompt` is the user's
 * next turn in that conversation. Strings and the sampling struct are copied before this returns. */
PIPESHARD_HOST_API pipeshard_status pipeshard_submit(pipeshard_host* host, pipeshard_session* session,
                                                     const char* prompt, const pipeshard_sampling* sampling,
                                                     pipeshard_token_callback on_token,
                                                     pipeshard_done_callback on_done, void* user_data,
                                                     pipeshard_request_id* out_request);
/* pipeshard_submit with a sentence callback too (NULL: as pipeshard_submit): each whole sentence of the answer goes to
 * `on_sentence` as it completes (see pipeshard_sentence_callback), for a game that speaks the answer. */
PIPESHARD_HOST_API pipeshard_status pipeshard_submit_with_sentences(pipeshard_host* host, pipeshard_session* session,
                                                                    const char* prompt,
                                                                    const pipeshard_sampling* sampling,
                                                                    pipeshard_token_callback on_token,
                                                                    pipeshard_sentence_callback on_sentence,
                                                                    pipeshard_done_callback on_done, void* user_data,
                                                                    pipeshard_request_id* out_request);
/* pipeshard_submit of a one-shot prompt with images (as pipeshard_generate_with_images); the pixels are copied. */
PIPESHARD_HOST_API pipeshard_status pipeshard_submit_with_images(pipeshard_host* host, const char* prompt,
                                                                 const pipeshard_image* images, size_t image_count,
                                                                 const pipeshard_sampling* sampling,
                                                                 pipeshard_token_callback on_token,
                                                                 pipeshard_done_callback on_done, void* user_data,
                                                                 pipeshard_request_id* out_request);
/* Stop a request from any thread: a running one stops before its next sub-layer run (or prompt chunk) and its
 * on_done gets PIPESHARD_ERR_CANCELLED; a queued one is reported so when the worker reaches it. An id that has
 * ended already is not an error. */
PIPESHARD_HOST_API pipeshard_status pipeshard_cancel(pipeshard_host* host, pipeshard_request_id request);
/* Wait until a request has ended (its on_done has returned); its status, or PIPESHARD_ERR_ARGUMENT for an unknown
 * id. timeout_ms < 0: wait as long as it takes; on timeout PIPESHARD_ERR_ARGUMENT and the request runs on. */
PIPESHARD_HOST_API pipeshard_status pipeshard_wait(pipeshard_host* host, pipeshard_request_id request, int timeout_ms);

/* A conversation (one per character) with its own KV cache kept between turns: each turn renders the whole
 * history with the pack's chat template and feeds only the tokens the cache does not hold yet. Many sessions share
 * one host; a session's requests run one at a time, in order. system_prompt NULL: the template's default. */
PIPESHARD_HOST_API pipeshard_status pipeshard_session_create(pipeshard_host* host, const char* system_prompt,
                                                             pipeshard_session** out_session);
/* The next user turn, waiting for the answer (pipeshard_submit with the session is the asynchronous form). A turn
 * that ends (end of sequence, length, stop string, callback) joins the history; a cancelled or failed one does not. */
PIPESHARD_HOST_API pipeshard_status pipeshard_session_say(pipeshard_session* session, const char* user_text,
                                                          const pipeshard_sampling* sampling,
                                                          pipeshard_token_callback callback, void* user_data);
/* Drop the last user turn and its answer (the cache keeps what the shorter history still shares). */
PIPESHARD_HOST_API pipeshard_status pipeshard_session_rollback(pipeshard_session* session);
/* The number of turns (user message and answer) in the history. */
PIPESHARD_HOST_API pipeshard_status pipeshard_session_turns(pipeshard_session* session, size_t* turns);
/* The history and its KV cache to a file, and back into a new session of a host opened on the same pack. */
PIPESHARD_HOST_API pipeshard_status pipeshard_session_save(pipeshard_session* session, const char* path);
PIPESHARD_HOST_API pipeshard_status pipeshard_session_load(pipeshard_host* host, const char* path,
                                                           pipeshard_session** out_session);
/* Cancel the session's requests, wait for them, free it. NULL is ignored. */
PIPESHARD_HOST_API void pipeshard_session_close(pipeshard_session* session);

/* Messages through the pack's chat template (ready for the next answer), as transformers' apply_chat_template with
 * add_generation_prompt renders them; `length` receives the size needed with the NUL. */
PIPESHARD_HOST_API pipeshard_status pipeshard_render_chat(pipeshard_host* host, const pipeshard_message* messages,
                                                          size_t count, char* text, size_t capacity, size_t* length);

/* Text <-> ids through tokenizer.onnx / detokenizer.onnx. `count` / `length` receive the size needed (with the
 * terminating NUL for text); a buffer too small gives PIPESHARD_ERR_ARGUMENT and is left untouched. */
PIPESHARD_HOST_API pipeshard_status pipeshard_tokenize(pipeshard_host* host, const char* text, int64_t* ids,
                                                       size_t capacity, size_t* count);
PIPESHARD_HOST_API pipeshard_status pipeshard_detokenize(pipeshard_host* host, const int64_t* ids, size_t count,
                                                         char* text, size_t capacity, size_t* length);

/* A fixed VRAM budget (a game took memory back, or gave it; this ends the AUTO mode): the plans of the largest
 * ladder rung that fits run from the next step on, keeping the KV cache. The ladder always ends with a 0-byte rung
 * that runs every unit on the CPU, so every budget fits some rung. */
PIPESHARD_HOST_API pipeshard_status pipeshard_set_vram_budget(pipeshard_host* host, uint64_t budget_bytes);
/* The AUTO mode: the budget is the device's free memory (plus what the host holds) minus `reserve_bytes`, read again
 * before every step. */
PIPESHARD_HOST_API pipeshard_status pipeshard_set_auto_budget(pipeshard_host* host, uint64_t reserve_bytes);
/* The game's own figure of the device memory free now (e.g. DXGI's budget minus current usage), which the AUTO mode
 * uses instead of asking the device from then on. */
PIPESHARD_HOST_API pipeshard_status pipeshard_set_free_vram(pipeshard_host* host, uint64_t free_bytes);
/* Free all device memory now (between two steps when a request runs); the next step uploads what its rung needs
 * again, so lower the budget first to keep the memory free. */
PIPESHARD_HOST_API pipeshard_status pipeshard_release(pipeshard_host* host);
/* Create the sessions and upload the weights of the rung in force, and run one token through, so that the first
 * request does not pay for it. */
PIPESHARD_HOST_API pipeshard_status pipeshard_warmup(pipeshard_host* host);

/* What the host has done, as one JSON object (device, budget, rung, steps, plan switches, device bytes in use
 * and at peak, streamed bytes, the last generation's prompt/decode timings and tokens/s). */
PIPESHARD_HOST_API pipeshard_status pipeshard_report(pipeshard_host* host, char* json, size_t capacity, size_t* length);

/* This thread's last failed call's message (`host` is not needed: NULL works too); never NULL, "" after a call
 * that succeeded. */
PIPESHARD_HOST_API const char* pipeshard_last_error(const pipeshard_host* host);
PIPESHARD_HOST_API const char* pipeshard_status_name(pipeshard_status status);

/* Cancel what is queued or running, stop the worker, free the host's sessions (their handles are invalid after),
 * the ONNX Runtime sessions, device memory and KV cache. NULL is ignored; from a callback it does nothing. */
PIPESHARD_HOST_API void pipeshard_close(pipeshard_host* host);

#ifdef __cplusplus
}
#endif

#endif /* PIPESHARD_HOST_H */
