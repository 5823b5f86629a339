"""serve.py: one real vLLM server on loopback, serving a base model and its adapters by name.

The base is the tests' warm start (a short SFT of the tiny model). The adapter root holds two
hand-made adapters `a` and `b` on it, one made for another base (the untrained tiny model), and
the tests' short GRPO run in `run1/`, whose export `run1/adapters/step_4` must replay, over HTTP,
the eval the trainer logged for it.
"""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import get_args

import pytest

import env
import evaluation
import rollout
import serve
from tasks.maze import INSTRUCTIONS, MazeTask
from tiny_model import random_lora


ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
API_KEY = "test-key"
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 120
EVAL = dict(difficulty="small", n=8, max_turns=15, max_new_tokens=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """Just enough HTTP to see status codes and bodies as they are, errors included."""

    def __init__(self, url: str):
        self.url = url
        self.base_replies = []  # the base model's replies to first_turns(8), before any adapter loaded

    def request(self, path: str, body=None, key: str | None = API_KEY, method: str = "POST"):
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def chat(self, model: str, messages: list, max_tokens: int = 16, key: str | None = API_KEY):
        return self.request("/v1/chat/completions", {"model": model, "messages": messages,
                                                     "temperature": 0.0, "max_tokens": max_tokens}, key)

    def reply_logprobs(self, model: str, messages: list, max_tokens: int = 8) -> tuple[str, list[float]]:
        """The greedy reply and the log-probability of each of its tokens."""
        status, body = self.request("/v1/chat/completions", {"model": model, "messages": messages, "temperature": 0.0,
                                                             "max_tokens": max_tokens, "logprobs": True})
        assert status == 200, f"{model}: {status} {body}"
        choice = body["choices"][0]
        return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]

    def reply(self, model: str, messages: list, max_tokens: int = 16) -> str:
        status, body = self.chat(model, messages, max_tokens)
        assert status == 200, f"{model}: {status} {body}"
        return body["choices"][0]["message"]["content"]


def first_turns(n: int) -> list:
    """The opening conversation of the first n eval mazes (instructions + image)."""
    conversations = []
    for game in env.held_out(MazeTask, "small", n):
        obs = game.reset()
        conversations.append([evaluation.chat_user_message(INSTRUCTIONS + "\n" + obs.text, obs.image)])
    return conversations


def offline_adapter(adapter_root: Path, name: str):
    """The in-process engine's request for adapter `name`, under an id no other test uses (vLLM
    keeps the first adapter it saw under an id)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"serve-test-{name}", {"a": 901, "b": 902}[name], str(adapter_root / name))


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def adapter_root(warm_start, tiny_model, tmp_path_factory) -> Path:
    """<root>/{a, b, other_base, broken} plus two links: `inside` -> a, and `escape` -> an adapter
    outside the root. `broken`'s adapter_config.json is cut short. (`run1/` comes later:
    trained_run.)"""
    root = tmp_path_factory.mktemp("adapters")
    outside = tmp_path_factory.mktemp("outside")
    random_lora(warm_start, root / "a", seed=1)
    random_lora(warm_start, root / "b", seed=2)
    random_lora(tiny_model, root / "other_base", seed=3)  # trained on the untrained tiny model
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')  # cut short
    shutil.copytree(root / "a", outside / "stolen")
    (root / "inside").symlink_to(root / "a")
    (root / "escape").symlink_to(outside / "stolen")
    return root


@pytest.fixture(scope="module")
def trained_run(adapter_root, short_run) -> Path:
    """<root>/run1: the tests' short GRPO run (conftest.SHORT_RUN), its step-4 export and the
    evaluations it logged, copied under the adapter root while the server runs (it loads an
    adapter when a request names it)."""
    run = adapter_root / "run1"
    shutil.copytree(short_run / "adapters" / "step_4", run / "adapters" / "step_4")
    shutil.copytree(short_run / "eval", run / "eval")
    return run


@pytest.fixture(scope="module")
def server(adapter_root, warm_start, tmp_path_factory):
    """`python serve.py` on a free loopback port with an API key; yields a Client."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    process = subprocess.Popen([PYTHON, "serve.py", "--model", str(warm_start), "--served-name", "maze",
                                "--adapters", str(adapter_root), "--port", str(port),
                                "--api-key", API_KEY, "--max-loras", "2", "--max-cpu-loras", "4"],
                               cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    client = Client(f"http://127.0.0.1:{port}")
    client.log = log_path
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log_path.read_text()[-5000:]}")
            try:
                if client.request("/health", method="GET", key=None)[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            if time.time() > deadline:
                pytest.fail(f"no /health after {START_TIMEOUT_S}s:\n{log_path.read_text()[-5000:]}")
            time.sleep(1)
        client.base_replies = [client.reply("maze", c, max_tokens=8) for c in first_turns(8)]
        yield client
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def base() -> str:
    return "maze"  # --served-name



# ----------------------------------------------------------------------------- serving

@pytest.mark.slow
def test_base_and_adapter_answer_a_chat_with_an_image(server, base):
    messages = first_turns(1)[0]
    base_reply = server.reply(base, messages)
    adapter_reply = server.reply(f"{base}:a", messages)
    assert base_reply and adapter_reply
    assert adapter_reply != base_reply
    assert server.reply(f"{base}:inside", messages) == adapter_reply  # a link that stays inside the root


@pytest.mark.slow
def test_trainer_export_replays_the_trainer_eval(server, base, trained_run):
    from safetensors.torch import load_file

    lora = load_file(str(trained_run / "adapters" / "step_4" / "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)  # a real update (PEFT starts B at 0)
    logged = json.loads((trained_run / "eval" / "step_4.json").read_text())
    model = f"{base}:run1/adapters/step_4"
    # the server plays the trained adapter, not the base: the same greedy replies may come out of
    # both (a few updates need not change an argmax), but not the same log-probs of them
    for messages in first_turns(2):
        ours, theirs = (server.reply_logprobs(m, messages) for m in (model, base))
        assert ours[0] != theirs[0] or abs(sum(ours[1]) - sum(theirs[1])) > 1e-4, "the adapter served as the base"
    result = serve.evaluate(server.url, model, **EVAL, api_key=API_KEY, progress=False)
    assert (result["solved"], result["total"]) == (logged["solved"], logged["total"])
    for ours, theirs in zip(result["puzzles"], logged["puzzles"]):  # every maze, every turn
        assert ours["replies"] == theirs["replies"], f"maze {ours['index']}"
    assert result["puzzles"] == logged["puzzles"]
    assert model in {m["id"] for m in server.request("/v1/models", method="GET")[1]["data"]}


@pytest.mark.slow
def test_eval_over_http_matches_the_in_process_eval(server, base, adapter_root, trained_run, engine, warm_start):
    from transformers import AutoProcessor

    # what evaluation.evaluate_run does, for an adapter that changes the replies
    banned = rollout.ChatFormat(AutoProcessor.from_pretrained(warm_start), []).banned_token_ids
    offline = evaluation.play_chat_episodes(
        env.held_out(MazeTask, "small", 8), evaluation.engine_replies(engine, offline_adapter(adapter_root, "a"), 8, banned),
        progress=False)
    served = serve.evaluate(server.url, f"{base}:a", **EVAL, api_key=API_KEY, progress=False)
    assert [row["replies"] for row in served["puzzles"]] == [e.replies for e in offline]
    base_rows = json.loads((trained_run / "eval" / "step_4.json").read_text())["puzzles"]
    assert [row["replies"] for row in served["puzzles"]] != [row["replies"] for row in base_rows]


@pytest.mark.slow
def test_an_adapter_trained_on_another_base_is_refused(server, base, warm_start, tiny_model):
    status, body = server.chat(f"{base}:other_base", first_turns(1)[0])
    assert status == 400, (status, body)
    assert f"it was trained on {tiny_model.resolve()}, this server serves {warm_start.resolve()}" in body
    assert "--allow-base-mismatch" in body
    assert f"adapter other_base: refused: it was trained on {tiny_model.resolve()}" in server.log.read_text()
    assert server.chat(f"{base}:a", first_turns(1)[0], max_tokens=2)[0] == 200  # the right base: served


@pytest.mark.slow
def test_two_adapters_side_by_side_match_offline_greedy(server, base, adapter_root, engine):
    from vllm import SamplingParams

    conversations = first_turns(4)
    offline = {name: [o.outputs[0].text for o in engine.chat(
        conversations, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False,
        lora_request=offline_adapter(adapter_root, name))] for name in ("a", "b")}
    assert offline["a"] != offline["b"]

    requests = [(name, i) for i in range(len(conversations)) for name in ("a", "b")]  # a, b, a, b, ...
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        replies = list(pool.map(lambda r: server.reply(f"{base}:{r[0]}", conversations[r[1]]), requests))
    for (name, i), reply in zip(requests, replies):
        assert reply == offline[name][i], f"adapter {name}, conversation {i}"


@pytest.mark.slow
def test_64_concurrent_requests_are_all_answered(server, base, adapter_root, engine):
    from vllm import SamplingParams

    conversations = first_turns(8)
    # what each model answers alone: the base before any adapter was loaded, adapters offline
    expected = {base: server.base_replies}
    for name in ("a", "b"):
        expected[f"{base}:{name}"] = [o.outputs[0].text for o in engine.chat(
            conversations, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False,
            lora_request=offline_adapter(adapter_root, name))]
    # base and adapter requests share batches: without serve.py's CPU fix for vLLM, the base ones
    # would get an adapter's delta here
    requests = [(model, i % len(conversations)) for i, model in
                zip(range(64), [base, f"{base}:a", f"{base}:b", base] * 16)]
    with ThreadPoolExecutor(max_workers=64) as pool:
        answers = list(pool.map(lambda r: server.chat(r[0], conversations[r[1]], max_tokens=8), requests))
    assert [status for status, _ in answers] == [200] * 64
    for (model, i), (_, body) in zip(requests, answers):
        assert body["choices"][0]["message"]["content"] == expected[model][i], (model, i)


def long_conversations(n: int, turns: int) -> list:
    """n conversations of `turns` moves each: one image per user turn, hundreds of tokens."""
    conversations = []
    for game in env.held_out(MazeTask, "small", n, max_turns=turns + 1):
        obs = game.reset()
        conversation = [evaluation.chat_user_message(INSTRUCTIONS + "\n" + obs.text, obs.image)]
        for _ in range(turns):
            obs = game.step("<answer>('move', 0)</answer>")
            conversation += [{"role": "assistant", "content": "<answer>('move', 0)</answer>"},
                             evaluation.chat_user_message(obs.text, obs.image)]
        conversations.append(conversation)
    return conversations


@pytest.mark.slow
def test_seeded_sampling_of_long_conversations(server, base):
    # more prompt tokens at once than vLLM's default step budget on CPU: a split prefill of a
    # seeded request used to kill the engine
    conversations = long_conversations(6, turns=12)

    def sample(i):
        return server.request("/v1/chat/completions", {"model": f"{base}:a", "messages": conversations[i],
                                                       "temperature": 1.0, "seed": i, "max_tokens": 4})

    with ThreadPoolExecutor(max_workers=len(conversations)) as pool:
        answers = list(pool.map(sample, range(len(conversations))))
    assert [status for status, _ in answers] == [200] * len(conversations), answers
    assert sum(body["usage"]["prompt_tokens"] for _, body in answers) > 4096


@pytest.mark.slow
def test_an_adapter_rewritten_while_served_is_served_anew(server, base, adapter_root, engine):
    """A resumed run redoes a step and replaces adapters/step_N (a new dir renamed over the old):
    the next request gets the new weights, not the ones vLLM loaded under that name before."""
    from vllm import SamplingParams

    messages = first_turns(1)[0]
    offline = {name: engine.chat([messages], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False,
                                 lora_request=offline_adapter(adapter_root, name))[0].outputs[0].text
               for name in ("a", "b")}
    assert offline["a"] != offline["b"]
    shutil.copytree(adapter_root / "b", adapter_root / "swap")
    assert server.reply(f"{base}:swap", messages) == offline["b"]
    shutil.copytree(adapter_root / "a", adapter_root / ".swap.tmp")  # as checkpoint.write_adapter does
    shutil.rmtree(adapter_root / "swap")
    (adapter_root / ".swap.tmp").rename(adapter_root / "swap")
    assert server.reply(f"{base}:swap", messages) == offline["a"]
    assert "[serve] adapter swap was rewritten on disk: its new weights are served from now on" in \
        server.log.read_text()


@pytest.mark.slow
def test_a_broken_adapter_config_is_named_and_the_rest_served(server, base):
    log = server.log.read_text()
    assert "[serve] adapter broken: skipped: adapter_config.json is not a PEFT LoRA config" in log
    assert server.chat(f"{base}:a", first_turns(1)[0], max_tokens=2)[0] == 200
    assert server.chat(f"{base}:broken", first_turns(1)[0], max_tokens=2)[0] in (400, 404)


# ----------------------------------------------------------------------------- refusals

@pytest.mark.slow
def test_bad_requests_get_a_clear_4xx_and_the_server_keeps_serving(server, base, adapter_root, warm_start):
    messages = [{"role": "user", "content": "hello"}]
    expect_404 = [f"{base}:nope", f"{base}:../x", f"{base}:a/../b", f"{base}:/etc", f"{base}:escape",
                  f"{base}:", "nope:a", "a", f"{base}:a\0", f"{base}:" + "x" * 5000]
    for model in expect_404:
        status, body = server.chat(model, messages)
        assert status == 404 and "does not exist" in body, (model, status, body)
        assert server.chat(base, messages, max_tokens=2)[0] == 200

    # adapters that appear after start-up and cannot be loaded: too big a rank, no weights
    random_lora(warm_start, adapter_root / "late" / "rank16", seed=3, rank=16)
    write_config(adapter_root / "late" / "no_weights", 8, base_model_name_or_path=str(warm_start))
    for name in ("late/rank16", "late/no_weights"):
        status, body = server.chat(f"{base}:{name}", messages)
        assert status == 400 and "could not be loaded" in body, (name, status, body)
        assert server.chat(base, messages, max_tokens=2)[0] == 200

    assert server.chat(base, messages, key=None)[0] == 401
    assert server.chat(base, messages, key="wrong")[0] == 401
    status, body = server.request("/v1/chat/completions", b'{"model": "' + base.encode() + b'", "messages": [')
    assert status == 400 and "JSON" in body
    # routes that would load an adapter from any path, or generate without the key, are not served
    load_request = {"lora_name": "x", "lora_path": "/tmp"}
    for path, body in [("/v1/load_lora_adapter", load_request), ("/adapters", {"name": "x", "src": "/tmp"}),
                       ("/invocations", {"model": base, "messages": messages})]:
        assert server.request(path, body, key=None)[0] == 404, path
        assert server.request(path, body)[0] == 404, path

    status, models = server.request("/v1/models", method="GET")
    assert status == 200
    served = {m["id"] for m in models["data"]}
    assert base in served and not any("escape" in m or ".." in m for m in served)
    assert server.reply(base, messages, max_tokens=2) is not None


# ----------------------------------------------------------------------------- start-up checks (no server)

def write_config(path: Path, rank: int, **extra):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, **extra}))


def test_max_lora_rank_must_fit_every_adapter(tmp_path):
    write_config(tmp_path / "small", 8)
    write_config(tmp_path / "run1" / "big", 16)
    write_config(tmp_path / ".big.tmp-1234", 64)  # a trainer export still being written: ignored
    adapters = serve.find_adapters(tmp_path)
    assert adapters == {"small": 8, "run1/big": 16}
    assert serve.choose_max_lora_rank(adapters, None) == 16
    assert serve.choose_max_lora_rank(adapters, 32) == 32
    with pytest.raises(SystemExit, match=r"--max-lora-rank 8 .*run1/big \(rank 16\)"):
        serve.choose_max_lora_rank(adapters, 8)
    assert serve.choose_max_lora_rank({"odd": 12}, None) == 16  # rounded up to a rank vLLM accepts
    write_config(tmp_path / "patterned", 8, rank_pattern={"q_proj": 32})
    assert serve.find_adapters(tmp_path)["patterned"] == 32
    with pytest.raises(SystemExit, match="vLLM accepts only"):
        serve.choose_max_lora_rank(adapters, 12)


def test_adapters_with_a_broken_config_are_left_out_and_named(tmp_path):
    write_config(tmp_path / "good", 8)
    for name, text in (("cut", '{"r": '), ("no_rank", '{"peft_type": "LORA"}'), ("list", "[8]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(text)
    skipped = {}
    assert serve.find_adapters(tmp_path, skipped) == {"good": 8}
    assert sorted(skipped) == ["cut", "list", "no_rank"]
    assert all(why.startswith("adapter_config.json is not a PEFT LoRA config (") and "\n" not in why
               for why in skipped.values())


def test_start_up_fails_clearly_when_an_adapter_is_too_big(tmp_path):
    write_config(tmp_path / "big", 16)
    result = subprocess.run([PYTHON, "serve.py", "--adapters", str(tmp_path), "--max-lora-rank", "8"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--max-lora-rank 8 is smaller than the rank of these adapters: big (rank 16)" in result.stderr


def test_our_rank_list_is_vllms():
    from vllm.config.lora import MaxLoRARanks

    assert serve.VLLM_LORA_RANKS == get_args(MaxLoRARanks)


def test_adapter_names_resolve_only_inside_the_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_config(root / "a", 8)
    write_config(root / "run1" / "step_20", 8)
    write_config(outside / "x", 8)
    (root / "inside").symlink_to(root / "a")
    (root / "escape").symlink_to(outside / "x")
    (root / "escape_dir").symlink_to(outside)
    (root / "empty").mkdir()
    (root / "loop").symlink_to(root / "loop")
    assert serve.adapter_dir(root, "a") == (root / "a").resolve()
    assert serve.adapter_dir(root, "run1/step_20") == (root / "run1" / "step_20").resolve()
    assert serve.adapter_dir(root, "inside") == (root / "a").resolve()
    for name in ["", "/", "nope", "empty", "run1", "../outside/x", "a/../a", "./a", "a/", "/etc",
                 str(outside / "x"), "escape", "escape_dir/x", ".hidden", "run1//step_20", "loop",
                 "loop/x", "a\0", "x" * 5000]:
        assert serve.adapter_dir(root, name) is None, name


def test_the_server_is_started_with_vllms_native_top_k_top_p_sampler(tmp_path, tiny_model, monkeypatch):
    """serve.py sets VLLM_USE_FLASHINFER_SAMPLER=0 before it imports vLLM (vLLM 0.33's CUDA wheel
    lacks FlashInfer's kernels, which a request with top-p/top-k would need compiled or fetched),
    so the engine core it starts inherits it; a value the user set stays. The server is not
    started: what it would start with is what run_server sees, parsed and validated by the
    installed vLLM's own parser and validator (a stand-in parser would take any argument)."""
    import os
    import types

    seen = []

    async def run_server(args):
        seen.append((os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"), args))

    _, make_arg_parser, validate_parsed_serve_args, _, parser_class = serve.vllm_server_api()
    registry = types.SimpleNamespace(register_resolver=lambda name, resolver: None)
    monkeypatch.setitem(sys.modules, "vllm.lora.resolver", types.SimpleNamespace(LoRAResolverRegistry=registry))
    monkeypatch.setattr(serve, "vllm_server_api",
                        lambda: (run_server, make_arg_parser, validate_parsed_serve_args, lambda: None, parser_class))
    monkeypatch.setattr(serve, "make_resolver", lambda root, served_name: None)
    monkeypatch.setattr(serve, "fix_cpu_lora_for_base_requests", lambda: None)
    monkeypatch.setattr(serve, "SERVING", {})
    for variable in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_LORA_RESOLVER_CACHE_DIR",
                     "VLLM_LORA_RESOLVER_HF_REPO_LIST"):
        monkeypatch.delenv(variable, raising=False)  # (serve sets or drops these; put back afterwards)
    for user, expected in ((None, "0"), ("1", "1")):
        if user is None:
            monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
        else:
            monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", user)
        serve.serve(["--model", str(tiny_model), "--adapters", str(tmp_path), "--port", str(free_port())])
        assert seen[-1][0] == expected and seen[-1][1].enable_lora and seen[-1][1].model == str(tiny_model)
