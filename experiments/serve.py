"""Serve a deployment over OpenAI's API: `python experiments/serve.py [target=... drafter=... decoding=...]`.

The same config groups as run.py build the deployment (default: SmolLM2-135M-Instruct and its shipped
block drafter); the engine runs the plan `+serve.plan=NAME` names (default: `stock` when the deployment
has a drafter, else `ar`). Then `POST /v1/chat/completions`, `POST /v1/completions` and `GET /v1/models`
answer on http://HOST:PORT/v1 (specpilot.serving.openai_server), e.g. with the official client:

    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=64, stream=True)

Options (this script's own, outside the run config's schema): `+serve.host=127.0.0.1`, `+serve.port=8000`,
`+serve.slots=4` (requests decoded at once), `+serve.context_len=2048` (prompt + reply per request),
`+serve.prefill_chunk=32`, `+serve.model=<name clients pass; default target.name>`,
`+serve.warm_up=true` (compile every step before taking requests; the compact decodes of
`specpilot.serving.compact` compile in the background, steps running the plain decode meanwhile), and the
server's limits
(specpilot.serving.http_limits.ServerLimits, each with its default there): `+serve.api_key_env=NAME`
(clients must send `Authorization: Bearer $NAME`), `+serve.max_queue`, `+serve.default_max_tokens`,
`+serve.max_body_bytes`, `+serve.max_connections`, `+serve.template_timeout_s`, the timeouts
`+serve.header_timeout_s`, `+serve.body_timeout_s`, `+serve.keep_alive_s`, and more.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import uvicorn
from omegaconf import DictConfig, open_dict

from specpilot.harness import config_errors, config_schema, deploy, devices, entry, fit
from specpilot.models.oracle import OracleDrafter
from specpilot.serving import Engine
from specpilot.serving.driver import EngineDriver
from specpilot.serving.http_limits import LimitError, ServerLimits, uvicorn_config
from specpilot.serving.openai_server import ServedModel, create_app

config_schema.register()
log = logging.getLogger("serve")
LIMITS = {f.name: f.default for f in dataclasses.fields(ServerLimits)}
OPTIONS = {"host": "127.0.0.1", "port": 8000, "slots": 4, "context_len": 2048, "prefill_chunk": 32,
           "model": None, "plan": None, "warm_up": True, **LIMITS}


def serve_options(cfg: DictConfig) -> tuple[dict, DictConfig]:
    """(this script's options with their defaults, the run config without them); an unknown option is
    refused naming it."""
    with open_dict(cfg):
        given = dict(cfg.pop("serve", None) or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        close = config_errors.nearest(unknown[0], OPTIONS)
        raise config_schema.ConfigValueError(f"serve.{unknown[0]}: not an option of serve.py"
                                             + (f"; did you mean '{close[0]}'?" if close else "")
                                             + f" (options: {', '.join(OPTIONS)})")
    return {**OPTIONS, **given}, config_schema.typed(cfg)


def server_limits(opts: dict) -> ServerLimits:
    """The server's limits from the options, the API key's variable checked; a bad one refused naming it."""
    given = {k: opts[k] for k in LIMITS}
    if given["api_key_env"] is not None:
        given["api_key_env"] = str(given["api_key_env"])
    try:
        limits = ServerLimits(**given)
        limits.api_key()
    except LimitError as e:
        raise config_schema.ConfigValueError(f"serve.{e.field}: {e.reason}") from None
    return limits


def build(cfg: DictConfig, opts: dict):
    """-> (the ASGI app, its started EngineDriver, the ServedModel) of the config's deployment."""
    config_schema.validate(cfg)
    limits = server_limits(opts)
    plans = config_schema.build_plans(cfg)
    has_drafter = cfg.drafter.source != "none"
    name = opts["plan"] or ("stock" if has_drafter and any(p.name == "stock" for p in plans) else "ar")
    by_name = {p.name: p for p in plans}
    if name not in by_name:
        raise config_schema.ConfigValueError(f"serve.plan: {name!r} is not a plan of this run "
                                             f"(decoding={cfg.decoding.name}: {', '.join(by_name)})")
    plan = by_name[name]
    for key in ("slots", "context_len", "prefill_chunk", "port"):
        if not isinstance(opts[key], int) or opts[key] < (0 if key == "port" else 1):
            raise config_schema.ConfigValueError(f"serve.{key}: must be a positive integer, got {opts[key]!r}")
    fit.preflight(cfg, [plan], batch=opts["slots"], slots=opts["context_len"])  # the engine's slots x context
    dep = deploy.build(cfg, [plan])
    if dep.tokenizer is None:
        raise config_schema.ConfigValueError(f"target: {cfg.target.name!r} has no tokenizer (random weights?); "
                                             f"the server speaks text: serve a target with one")
    if plan.uses_drafter and isinstance(dep.drafter[0], OracleDrafter):
        raise config_schema.ConfigValueError("drafter: an oracle drafter replays a known continuation, which a "
                                             "served request does not have; serve a real drafter or plan ar")
    engine = Engine.from_plan(dep, plan, slots=opts["slots"], context_len=opts["context_len"],
                              prefill_chunk=opts["prefill_chunk"], top_k=dep.sampling.top_k)
    if opts["warm_up"]:
        log.info("compiling the engine's steps (plan %s, %d slots)", plan.name, opts["slots"])
        engine.warm_up(compact_in_background=True)  # the many compact decodes: no step waits for them
    served = ServedModel(str(opts["model"] or cfg.target.name), dep.tokenizer, dep.chat_template,
                         dep.tokenizer.eos_id, opts["context_len"], sampling=engine.sampling)
    driver = EngineDriver(engine).start()
    log.info("serving %s (plan %s: %s) with %d slots of %d tokens", served.name, plan.name, plan.describe(),
             opts["slots"], opts["context_len"])
    return create_app(driver, served, limits), driver, served


@entry.app(config_path="../conf", config_name="config", options="serve")
def main(cfg: DictConfig) -> None:
    try:
        opts, cfg = serve_options(cfg)
        devices.setup(cfg)
        if cfg.compile_cache:
            devices.enable_compile_cache(Path(cfg.cache_dir).expanduser() / "xla")
        app, driver, served = build(cfg, opts)
    except Exception as e:
        entry.report(e)
    print(f"serving {served.name} on http://{opts['host']}:{opts['port']}/v1", flush=True)
    try:
        config = uvicorn_config(app, str(opts["host"]), int(opts["port"]), server_limits(opts), log_level="info")
        uvicorn.Server(config).run()
    finally:
        driver.stop()


if __name__ == "__main__":
    main()
