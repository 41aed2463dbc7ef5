"""experiments/serve.py: its options, its refusals, and (slow) the default deployment served end to end."""

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specpilot.data.chat import render_chat
from specpilot.decoding.ar import generate
from specpilot.harness import config_schema
from specpilot.harness.config_schema import ConfigValueError

pytest.importorskip("fastapi")
from specpilot.serving.http_limits import ServerLimits  # noqa: E402
from specpilot.serving.openai_server import serve_in_thread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _serve_module():
    spec = importlib.util.spec_from_file_location("serve_script", ROOT / "experiments" / "serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compose(overrides):
    config_schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


TINY = ["target=tiny_random", "drafter=none", "decoding=ar", "bench=default"]


def test_serve_options_take_defaults_and_refuse_unknown_ones():
    serve = _serve_module()
    opts, cfg = serve.serve_options(_compose(TINY + ["+serve.port=0", "+serve.slots=2"]))
    assert (opts["port"], opts["slots"], opts["context_len"], opts["plan"]) == (0, 2, 2048, None)
    assert "serve" not in cfg
    with pytest.raises(ConfigValueError, match="serve.slot: not an option of serve.py"):
        serve.serve_options(_compose(TINY + ["+serve.slot=2"]))


def test_the_servers_limits_are_options_and_bad_ones_are_refused_naming_them(monkeypatch):
    serve = _serve_module()
    opts, _ = serve.serve_options(_compose(TINY + ["+serve.max_queue=3", "+serve.default_max_tokens=9",
                                                   "+serve.header_timeout_s=2.5"]))
    limits = serve.server_limits(opts)
    assert (limits.max_queue, limits.default_max_tokens, limits.header_timeout_s) == (3, 9, 2.5)
    assert limits.max_body_bytes == ServerLimits().max_body_bytes
    with pytest.raises(ConfigValueError, match=r"serve.max_queue: must be a positive integer, got 0"):
        serve.server_limits(serve.serve_options(_compose(TINY + ["+serve.max_queue=0"]))[0])
    monkeypatch.delenv("SPECPILOT_SERVE_KEY", raising=False)
    opts, _ = serve.serve_options(_compose(TINY + ["+serve.api_key_env=SPECPILOT_SERVE_KEY"]))
    with pytest.raises(ConfigValueError, match="serve.api_key_env: the variable 'SPECPILOT_SERVE_KEY' is unset"):
        serve.server_limits(opts)
    monkeypatch.setenv("SPECPILOT_SERVE_KEY", "k")
    assert serve.server_limits(opts).api_key() == "k"


def test_a_plan_the_run_lacks_and_a_target_without_text_are_refused():
    serve = _serve_module()
    opts, cfg = serve.serve_options(_compose(TINY + ["+serve.plan=stock"]))
    with pytest.raises(ConfigValueError, match=r"serve.plan: 'stock' is not a plan of this run \(decoding=ar: ar\)"):
        serve.build(cfg, opts)
    opts, cfg = serve.serve_options(_compose(TINY))
    with pytest.raises(ConfigValueError, match="target: 'tiny_random' has no tokenizer"):
        serve.build(cfg, opts)


@pytest.mark.slow
def test_the_default_deployment_serves_a_chat_reply_equal_to_its_engine():
    """The stock plan (SmolLM2 + shipped drafter) behind the server: its greedy reply equals the AR plan's
    tokens from ar.generate, which is what the engine promises for a lossless plan."""
    openai = pytest.importorskip("openai")

    serve = _serve_module()
    opts, cfg = serve.serve_options(_compose(["+serve.context_len=256", "+serve.warm_up=false",
                                              "+serve.slots=2"]))
    app, driver, served = serve.build(cfg, opts)
    assert driver.engine.setup.uses_drafter and driver.engine.setup.block_size == 4  # stock_cpu's plan
    srv, thread, port = serve_in_thread(app)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What does Python's len() do?"}]
        r = client.chat.completions.create(model=served.name, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"return_token_ids": True})
        prompt = served.tokenizer.encode(render_chat(served.chat_template, messages))
        engine = driver.engine
        ref = generate(engine.setup.target, engine.target_params, [prompt], 16,
                       stop_token=served.stop_token).tokens[0].tolist()
        ref = ref[: ref.index(served.stop_token) + 1] if served.stop_token in ref else ref
        assert r.choices[0].model_extra["token_ids"] == ref
        assert r.usage.prompt_tokens == len(prompt)
    finally:
        srv.should_exit = True
        thread.join(10)
        driver.stop()

