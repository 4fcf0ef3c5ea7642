/* pipeshard native host: run a pipeshard model pack with its saved plans through ONNX Runtime's C API alone.
 *
 * A C ABI over a C++17 library, for game engines (Unreal from C++, Unity from C# through PipeshardHost.cs).
 * Every function returns a status; on failure pipeshard_last_error(host) holds one line saying what went wrong
 * (pipeshard_last_error(NULL) for a failed pipeshard_open). No function throws or aborts on bad input.
 * One host is used from one thread at a time, except pipeshard_set_vram_budget, which any thread may call while
 * pipeshard_generate runs: the new budget takes effect between two steps. See docs/native-host.md. */
#ifndef PIPESHARD_HOST_H
#define PIPESHARD_HOST_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(PIPESHARD_HOST_BUILD)
#define PIPESHARD_API __declspec(dllexport)
#else
#define PIPESHARD_API __declspec(dllimport)
#endif
#else
#define PIPESHARD_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define PIPESHARD_HOST_ABI_VERSION 1

typedef enum pipeshard_status {
    PIPESHARD_OK = 0,
    PIPESHARD_ERR_ARGUMENT = 1, /* a null pointer, a bad option or sampling value, a buffer too small */
    PIPESHARD_ERR_PACK = 2,     /* the pack is missing, corrupt, of another schema, or needs a newer ONNX Runtime */
    PIPESHARD_ERR_PLANS = 3,    /* the plans file is unreadable, of another schema, or made for another pack */
    PIPESHARD_ERR_BUDGET = 4,   /* a VRAM budget below every rung of the plans file's ladder */
    PIPESHARD_ERR_DEVICE = 5,   /* the device asked for is not usable here (no CUDA EP, no GPU) */
    PIPESHARD_ERR_CONTEXT = 6,  /* the prompt and max_new_tokens do not fit the KV cache's context */
    PIPESHARD_ERR_RUNTIME = 7   /* ONNX Runtime failed while running (its message follows) */
} pipeshard_status;

typedef struct pipeshard_host pipeshard_host;

typedef struct pipeshard_options {
    int abi_version;                /* PIPESHARD_HOST_ABI_VERSION (set by pipeshard_default_options) */
    const char* plans_path;         /* a plans.json of `pipeshard plan PACK --out`, or NULL: every unit on the CPU */
    const char* device;             /* "cpu" (the default; only with no plans), "sim" or "cuda" */
    const char* extensions_library; /* path of libortextensions (tokenizer ops); NULL: no text, token ids only */
    int threads;                    /* intra-op threads; 0: all cores */
    int context;                    /* KV capacity in tokens; 0: the plans file's, else min(4096, the model's) */
    uint64_t vram_budget_bytes;     /* 0: the largest rung of the plans file's ladder */
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
} pipeshard_sampling;

/* Called once per generated token with its id and the text it completes (UTF-8, maybe empty while a multi-byte
 * character is incomplete; empty without an extensions library). Return nonzero to stop generating. */
typedef int (*pipeshard_token_callback)(int64_t token_id, const char* text_piece, void* user_data);

PIPESHARD_API void pipeshard_default_options(pipeshard_options* options);
PIPESHARD_API void pipeshard_default_sampling(pipeshard_sampling* sampling);

/* Open the pack folder: check its manifest (and the plans file against it), create the sessions, size the KV. */
PIPESHARD_API pipeshard_status pipeshard_open(const char* pack_dir, const pipeshard_options* options,
                                              pipeshard_host** out_host);

/* Generate from text (tokenized by the pack's tokenizer.onnx) or from token ids. The KV cache starts empty. */
PIPESHARD_API pipeshard_status pipeshard_generate(pipeshard_host* host, const char* prompt,
                                                  const pipeshard_sampling* sampling,
                                                  pipeshard_token_callback callback, void* user_data);
PIPESHARD_API pipeshard_status pipeshard_generate_ids(pipeshard_host* host, const int64_t* prompt_ids,
                                                      size_t prompt_length, const pipeshard_sampling* sampling,
                                                      pipeshard_token_callback callback, void* user_data);

/* Text <-> ids through tokenizer.onnx / detokenizer.onnx. `count` / `length` receive the size needed (with the
 * terminating NUL for text); a buffer too small gives PIPESHARD_ERR_ARGUMENT and is left untouched. */
PIPESHARD_API pipeshard_status pipeshard_tokenize(pipeshard_host* host, const char* text, int64_t* ids,
                                                  size_t capacity, size_t* count);
PIPESHARD_API pipeshard_status pipeshard_detokenize(pipeshard_host* host, const int64_t* ids, size_t count,
                                                    char* text, size_t capacity, size_t* length);

/* A new VRAM budget (a game took memory back, or gave it): the plans of the largest ladder rung that fits run from
 * the next step on, keeping the KV cache. Below every rung: PIPESHARD_ERR_BUDGET, and nothing changes. */
PIPESHARD_API pipeshard_status pipeshard_set_vram_budget(pipeshard_host* host, uint64_t budget_bytes);

/* What the host has done, as one JSON object (device, budget, rung, steps, plan switches, device bytes in use
 * and at peak, streamed bytes, the last generation's prompt/decode timings and tokens/s). */
PIPESHARD_API pipeshard_status pipeshard_report(pipeshard_host* host, char* json, size_t capacity, size_t* length);

/* The last error of `host` (of this thread's last pipeshard_open when NULL); never NULL, "" when none. */
PIPESHARD_API const char* pipeshard_last_error(const pipeshard_host* host);
PIPESHARD_API const char* pipeshard_status_name(pipeshard_status status);

/* Release the sessions, device memory and KV cache; NULL is ignored. */
PIPESHARD_API void pipeshard_close(pipeshard_host* host);

#ifdef __cplusplus
}
#endif

#endif /* PIPESHARD_HOST_H */
