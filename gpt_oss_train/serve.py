"""Serve a GPT-OSS checkpoint behind OpenAI's API (chat, completions, streaming, Harmony
reasoning and tool calls):

    python -m gpt_oss_train.serve --checkpoint=DIR [--host=127.0.0.1 --port=8000
        --max_slots=8 --max_context=N --dtype=float32 --int8_weights --int8_kv_cache
        --served_model_name=NAME --api_key=KEY --adapter=NAME=DIR,NAME2=DIR2
        --config.mesh.tensor=2 ...]

--checkpoint and --config are decode's (an Orbax checkpoint or a Hugging Face folder; the
runtime config sets mesh, dtype and kernels). The engine starts with --max_slots decode
slots of --max_context positions each and says what memory it holds. Without
--max_context a slot holds 4096 positions, or the model's max_position_embeddings if it
has fewer (the log says which); a --max_context above the model's positions is refused.
SIGTERM (or Ctrl-C) stops accepting connections, lets running requests finish for up to
--grace_period_s seconds, and exits 0.

--api_key=KEY (or the environment variable GPT_OSS_TRAIN_API_KEY when the flag is not
given; the variable keeps the key out of `ps`): every /v1/* request must send
`Authorization: Bearer KEY`, else it gets 401 with OpenAI's error JSON (code
"invalid_api_key"); /health and /metrics stay open. The `openai` client sends its
`api_key` that way. Serving on an address other than loopback without a key logs a
warning: anyone who can reach the port can use the model.

--adapter is decode's: LoRA adapters beside the base, never merged. --adapter=DIR: every
request uses that adapter. --adapter=NAME=DIR,...: a request picks one by sending
"model": NAME (the served model name gives the base), and /v1/models lists them all.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os

from absl import app, flags, logging

from gpt_oss_train import errors, runtime, sharding
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.loading import DecodeError

DEFAULT_MAX_CONTEXT = 4096  # positions per slot without --max_context, if the model has them
API_KEY_ENV = "GPT_OSS_TRAIN_API_KEY"


def get_config():
    """The runtime config without --config (this file is --config's default)."""
    return loading.default_runtime_config()


def _define_flags():
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", os.path.abspath(__file__), "Runtime config (mesh, dtype, kernels)."
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Orbax checkpoint / workdir, or a HF gpt-oss folder (with --adapter: default, the "
        "base the adapter was trained on).",
    )
    flags.DEFINE_list(
        "adapter",
        [],
        "LoRA adapters beside the base, unmerged: DIR (every request uses it) or "
        'NAME=DIR,NAME2=DIR2 (a request sends "model": NAME; the served name: the base). '
        "DIR: a PEFT adapter folder or a LoRA training workdir.",
    )
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    flags.DEFINE_integer("port", 8000, "Port to listen on.")
    flags.DEFINE_string("served_model_name", None, "Model name in the API (default: folder name).")
    flags.DEFINE_integer("max_slots", 8, "Requests decoded together (continuous batching).")
    flags.DEFINE_integer(
        "max_context",
        None,
        f"Most positions (prompt + output) per request (default: {DEFAULT_MAX_CONTEXT}, or the "
        "model's max_position_embeddings if fewer).",
    )
    flags.DEFINE_string(
        "api_key",
        None,
        "Key clients must send on /v1/* as 'Authorization: Bearer KEY' (default: "
        f"${API_KEY_ENV}; neither: no key). /health and /metrics stay open.",
    )
    flags.DEFINE_integer("prefill_chunk", 256, "Most prompt tokens per prefill step.")
    flags.DEFINE_integer("max_queue", 0, "Most requests waiting for a slot (0: the engine's).")
    flags.DEFINE_integer(
        "prefix_cache_tokens", -1, "Prompt tokens kept for reuse (-1: the engine's, 0: off)."
    )
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_bool("int8_weights", False, "int8 weight-only quantized matmuls.")
    flags.DEFINE_bool("int8_kv_cache", False, "int8 KV cache.")
    flags.DEFINE_float("grace_period_s", 30.0, "On SIGTERM: how long running requests may go on.")
    flags.DEFINE_bool("access_log", False, "Log every HTTP request.")


def _check_flags(f) -> None:
    if not 0 <= f.port < 65536:
        raise DecodeError(f"--port must be in [0, 65536), got {f.port}")
    for name in ("max_slots", "max_context", "prefill_chunk"):
        if f[name].value is not None and f[name].value < 1:
            raise DecodeError(f"--{name} must be >= 1, got {f[name].value}")
    if f.max_queue < 0 or f.grace_period_s < 0:
        raise DecodeError("--max_queue and --grace_period_s must be >= 0")


def choose_max_context(flag: int | None, model_positions: int) -> tuple[int, str]:
    """(positions per slot, why): --max_context if given (no more than the model has),
    else DEFAULT_MAX_CONTEXT or the model's max_position_embeddings, the fewer."""
    if flag is not None:
        if flag > model_positions:
            raise DecodeError(
                f"--max_context={flag} exceeds the model's max_position_embeddings="
                f"{model_positions}; give at most {model_positions} or leave it out"
            )
        return flag, "--max_context"
    if model_positions < DEFAULT_MAX_CONTEXT:
        return model_positions, "the model's max_position_embeddings; --max_context to change"
    return DEFAULT_MAX_CONTEXT, (
        f"the default; the model has {model_positions} positions, --max_context to use more"
    )


def choose_api_key(flag: str | None) -> str | None:
    """--api_key, else $GPT_OSS_TRAIN_API_KEY; "" (either) means no key."""
    key = os.environ.get(API_KEY_ENV) if flag is None else flag
    return key or None


def open_host_warning(host: str, key: str | None) -> str | None:
    """The warning to log when the server listens beyond this machine without a key."""
    if key or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:  # a host name, or "" (every interface): it may be reachable
        pass
    return (
        f"--host={host} is not a loopback address and no API key is set: anyone who can "
        f"reach this port can use the model; set --api_key or ${API_KEY_ENV}"
    )


def _engine(f, adapters, positions: int):
    from gpt_oss_train.inference.engine import Engine

    kw = dict(
        adapters=adapters,
        config=f["config"].value,
        dtype=f.dtype,
        max_slots=f.max_slots,
        max_context=positions,
        prefill_chunk=f.prefill_chunk,
        int8_weights=f.int8_weights,
        int8_kv_cache=f.int8_kv_cache,
    )
    if f.max_queue:
        kw["max_queue"] = f.max_queue
    if f.prefix_cache_tokens >= 0:
        kw["prefix_cache_tokens"] = f.prefix_cache_tokens
    return Engine.from_checkpoint(f.checkpoint, **kw)


def serve(app_, host: str, port: int, grace_s: float, access_log: bool = False) -> None:
    """Run the app until SIGTERM / SIGINT; returns once running requests are done (or the
    grace period is over)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app_.state.shutting_down = True  # /health says so while requests finish
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a caught SIGTERM after its graceful shutdown, which ends
            # the process with status 143; here SIGTERM is the normal way to stop: exit 0.
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    config = uvicorn.Config(
        app_,
        host=host,
        port=port,
        timeout_graceful_shutdown=grace_s,
        access_log=access_log,
        log_level="info",
        lifespan="off",
    )
    Server(config).run()


def _run(f) -> int:
    from gpt_oss_train.inference import adapters as adapters_lib
    from gpt_oss_train.inference.server.app import create_app

    _check_flags(f)
    key = choose_api_key(f.api_key)
    warning = open_host_warning(f.host, key)
    if warning:
        logging.warning("%s", warning)
    adapters = adapters_lib.parse_flag(f.adapter)
    if adapters and not f.checkpoint:
        f.checkpoint = adapters_lib.base_of(adapters)
    kind = loading.checkpoint_kind(f.checkpoint)
    arch = loading.read_architecture(f.checkpoint, kind)
    positions, why = choose_max_context(f.max_context, arch["max_position_embeddings"])
    logging.info("max_context %d (%s)", positions, why)
    name = f.served_model_name or os.path.basename(os.path.abspath(f.checkpoint))
    if name in [n for n, _ in adapters]:
        raise DecodeError(
            f"--adapter: {name!r} is also the served model's name (the base); rename the "
            "adapter or pass --served_model_name"
        )
    eng = _engine(f, adapters, positions)
    eng.start()
    app_ = create_app(
        eng,
        tokenizer=loading.tokenizer(),
        model_name=name,
        max_context=positions,
        vocab_size=arch["vocab_size"],
        api_key=key,
    )
    served = ", ".join((name, *eng.adapters))
    logging.info("Serving %s at http://%s:%d/v1", served, f.host, f.port)
    if key:
        source = "--api_key" if f.api_key else f"${API_KEY_ENV}"
        logging.info("/v1/* requires the API key of %s", source)
    try:
        serve(app_, f.host, f.port, f.grace_period_s, f.access_log)
    finally:
        eng.stop(0.0)
    logging.info("Server stopped")
    return 0


def main(argv):
    runtime.setup_process(sharding.platform())
    return errors.run_command(lambda: _run(flags.FLAGS), argv)


def run():
    """The `gpt-oss-serve` console script: `python -m gpt_oss_train.serve`."""
    _define_flags()
    app.run(main, flags_parser=errors.parse_flags)


if __name__ == "__main__":
    run()
