"""The target's own replies to chat prompts, generated through the serving engine in resumable shards
(docs/training.md#replies-in-shards-drafter-v2).

- The replies form one fixed list: pass p of `temperatures` gives every prompt one reply at temperature p
  (0: greedy), prompts in a seeded order, each sampled reply with a seed of its own; shard k holds replies
  k*shard_size .. (k+1)*shard_size - 1 of that list, so a shard is a pure function of the settings and k.
- `manifest.json` holds the settings' key (target weights, prompts, temperatures, lengths, seed, ...): a run
  against a folder made with other settings is refused, naming what differs. `prompts.json` names each
  prompt's kind and source (file:line), to check held-out files never feed the replies.
- Each shard is one .npz written whole or not at all (`atomic_io`); a run writes shards until the target
  count or its time budget, and the next run continues with the first missing one.
- Each shard's requests go into the engine together and it runs until all are done, so a shard's replies
  never depend on what ran before it (a resumed run writes the same shards as an uninterrupted one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from specpilot import atomic_io
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.plan import Batching
from specpilot.serving.engine import Engine
from specpilot.serving.request import MAX_SEED, Request
from specpilot.training.drafter import Sequences

MANIFEST = "manifest.json"
SOURCES = "prompts.json"
FORMAT = 1
POLICIES = ("static", "continuous")


class RepliesError(ValueError):
    """A replies folder that cannot serve the request: other settings, or shards missing."""


@dataclasses.dataclass(frozen=True)
class RepliesConfig:
    """How the replies are generated. The key fields (all but `num_replies`, `slots`, `prefill_chunk`,
    `policy`) fix every shard's content; `num_replies` is how many a run aims at, whole shards."""

    num_replies: int = 102_400
    shard_size: int = 4096
    temperatures: tuple[float, ...] = (0.0,)  # one reply per prompt per entry, in this order; 0 = greedy
    top_p: float = 1.0  # sampled replies only
    max_new_tokens: int = 256
    seed: int = 0
    # The engine: rows decoded together, prompt tokens fed per prefill call, admission policy. `static`
    # admits a wave once every slot is free: the engine's prefill computes every slot's row, so under
    # `continuous` admission nearly every step pays a [slots, prefill_chunk] forward for a few new rows.
    slots: int = 512
    prefill_chunk: int = 128
    policy: str = "static"

    def check(self) -> None:
        for name in ("num_replies", "shard_size", "max_new_tokens", "slots", "prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"replies.{name} must be an integer >= 1, got {value!r}")
        if not self.temperatures:
            raise ValueError("replies.temperatures is empty: give at least one (0 = greedy)")
        for t in self.temperatures:
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
                raise ValueError(f"replies.temperatures must be finite numbers >= 0, got {t!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"replies.top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"replies.seed must be in [0, {MAX_SEED}], got {self.seed!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"replies.policy must be one of {POLICIES}, got {self.policy!r}")


@dataclasses.dataclass(frozen=True)
class ReplyOrder:
    """The list of replies: reply r answers prompt `prompt[r]` at `temperature[r]` with PRNG `seed[r]`."""

    prompt: np.ndarray  # [R] int32 index into the prompts
    temperature: np.ndarray  # [R] float32
    seed: np.ndarray  # [R] int32

    def __len__(self) -> int:
        return len(self.prompt)


def reply_order(cfg: RepliesConfig, num_prompts: int) -> ReplyOrder:
    """Pass p answers every prompt at temperatures[p], the prompts in one order drawn from the seed."""
    order = np.random.default_rng([cfg.seed, 11]).permutation(num_prompts).astype(np.int32)
    passes = len(cfg.temperatures)
    r = np.arange(num_prompts * passes, dtype=np.int64)
    seeds = np.random.default_rng([cfg.seed, 13]).integers(0, MAX_SEED, size=len(r), dtype=np.int64)
    return ReplyOrder(prompt=np.tile(order, passes),
                      temperature=np.repeat(np.asarray(cfg.temperatures, np.float32), num_prompts),
                      seed=seeds.astype(np.int32))


def weights_digest(params) -> str:
    """sha256 of every weight's bytes, dtype and shape: exact on any backend (a float sum is not)."""
    h = hashlib.sha256()
    leaves = [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
    for name, leaf in sorted(leaves, key=lambda kv: kv[0]):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{name}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:24]


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:24]


def manifest_key(cfg: RepliesConfig, prompts: Sequence[Sequence[int]], target_params, target_cfg: ModelConfig,
                 stop_token: int | None, about: dict | None = None) -> dict:
    """What every shard's content depends on (`about`: the caller's own, e.g. request kinds)."""
    return {"format": FORMAT,
            "target": {"weights": weights_digest(target_params), "architecture": target_cfg.architecture,
                       "vocab_size": target_cfg.vocab_size, "num_layers": target_cfg.num_layers},
            "prompts": {"count": len(prompts), "digest": prompts_digest(prompts)},
            "stop_token": stop_token, "temperatures": [float(t) for t in cfg.temperatures],
            "top_p": float(cfg.top_p), "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "shard_size": cfg.shard_size, **(about or {})}


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def shard_path(out_dir: str | Path, k: int) -> Path:
    return Path(out_dir) / f"shard-{k:05d}.npz"


def num_shards(num_replies: int, shard_size: int, available: int) -> int:
    """Shards holding the first `num_replies` replies (whole shards; at most every available reply)."""
    return math.ceil(min(num_replies, available) / shard_size)


def open_folder(out_dir: Path, key: dict, sources: Sequence[dict] | None) -> dict:
    """The folder's manifest, written with `sources` if absent; another key is refused."""
    path = out_dir / MANIFEST
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") != key:
            old = saved.get("key") or {}
            changed = {k: (old.get(k), key.get(k)) for k in sorted(set(old) | set(key))
                       if old.get(k) != key.get(k)}
            raise RepliesError(f"the replies in {out_dir} were generated with other settings (saved, now): "
                               f"{changed}; use another replies folder, or the settings it was made with")
        return saved
    manifest = {"key": key, "id": key_id(key)}
    if sources is not None:
        atomic_io.write_json(out_dir / SOURCES, list(sources))
    atomic_io.write_json(path, manifest, indent=1)  # last: a folder with a manifest has its prompts file
    return manifest


def _shard_id(path: Path) -> str | None:
    """The key id a readable shard was written for (None: absent; a torn one is removed with a warning)."""
    def load(p: Path) -> str:
        with np.load(p) as data:
            if data["tokens"].ndim != 2:  # reading the member whole: a truncated one raises here
                raise ValueError(f"tokens of shape {data['tokens'].shape}, not [replies, positions]")
            return str(data["key"])
    return atomic_io.read_cache(path, load, "a replies shard")


def generate_shard(engine: Engine, prompts: Sequence[Sequence[int]], order: ReplyOrder, rows: np.ndarray,
                   width: int, cfg: RepliesConfig, stop_token: int | None, vocab_size: int) -> dict:
    """The replies `rows` of the order, through the engine (all submitted, run to the end) -> shard arrays."""
    handles = []
    for r in rows:
        t = float(order.temperature[r])
        handles.append(engine.submit(Request(
            prompt_ids=prompts[order.prompt[r]], max_new_tokens=cfg.max_new_tokens, temperature=t,
            top_p=cfg.top_p if t > 0 else 1.0, seed=int(order.seed[r]), stop_token=stop_token)))
    steps = engine.stats.steps
    engine.run()
    tokens = np.zeros((len(rows), width), np.uint16 if vocab_size <= 2**16 else np.int32)
    starts, ends = np.zeros(len(rows), np.int32), np.zeros(len(rows), np.int32)
    for i, (r, h) in enumerate(zip(rows, handles)):
        prompt = prompts[order.prompt[r]]
        reply = h.tokens[: cfg.max_new_tokens]
        tokens[i, : len(prompt)] = prompt
        tokens[i, len(prompt): len(prompt) + len(reply)] = reply
        starts[i], ends[i] = len(prompt), len(prompt) + len(reply)
    return {"tokens": tokens, "starts": starts, "ends": ends, "reply": rows.astype(np.int64),
            "prompt_index": order.prompt[rows], "temperature": order.temperature[rows],
            "seed": order.seed[rows],
            "stopped": np.array([h.finish_reason == "stop" for h in handles]),
            "engine_steps": engine.stats.steps - steps}


@dataclasses.dataclass(frozen=True)
class RepliesProgress:
    done: int  # shards in the folder (of the target count)
    total: int  # shards of the target count
    written: int  # shards this run wrote
    seconds: float

    @property
    def complete(self) -> bool:
        return self.done >= self.total


def generate_replies(cfg: RepliesConfig, target_params, target_cfg: ModelConfig,
                     prompts: Sequence[Sequence[int]], out_dir: str | Path, *, stop_token: int | None,
                     sources: Sequence[dict] | None = None, about: dict | None = None,
                     max_minutes: float | None = None, progress: bool = True) -> RepliesProgress:
    """Write the shards of the first `cfg.num_replies` replies that `out_dir` lacks.

    `sources`: one record per prompt (e.g. {"kind", "where"}), kept in prompts.json. `max_minutes`: no shard
    starts once the time spent plus one shard's time so far would pass it (the first always runs), so the
    run ends inside its budget and the next run continues. Returns how far the folder got."""
    cfg.check()
    if not prompts:
        raise ValueError("no prompts to reply to")
    if sources is not None and len(sources) != len(prompts):
        raise ValueError(f"{len(sources)} sources for {len(prompts)} prompts")
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    order = reply_order(cfg, len(prompts))
    if cfg.num_replies > len(order):
        raise ValueError(f"replies.num_replies={cfg.num_replies}, but {len(prompts)} prompts x "
                         f"{len(cfg.temperatures)} temperatures give {len(order)} replies; ask for fewer, add "
                         f"temperatures (one more reply per prompt each) or request kinds")
    key = manifest_key(cfg, prompts, target_params, target_cfg, stop_token, about)
    kid = open_folder(out_dir, key, sources)["id"]
    total = num_shards(cfg.num_replies, cfg.shard_size, len(order))
    todo = [k for k in range(total) if _shard_id(shard_path(out_dir, k)) != kid]
    width = max(len(p) for p in prompts) + cfg.max_new_tokens
    engine, written, spent = None, 0, []
    bar = tqdm(total=total, initial=total - len(todo), desc="replies (shards)", disable=not progress)
    for k in todo:
        elapsed = time.perf_counter() - t0
        if max_minutes is not None and spent and elapsed + np.mean(spent) > 60 * max_minutes:
            break
        if engine is None:  # built once a shard is due: a finished folder costs no compile
            engine = Engine(dense.target(target_cfg, target_params["embed"].dtype), target_params,
                            slots=min(cfg.slots, cfg.shard_size), context_len=width,
                            prefill_chunk=min(cfg.prefill_chunk, width), sampling=max(cfg.temperatures) > 0,
                            batching=Batching(policy=cfg.policy),
                            compact=False)  # fixed shapes: a reply never depends on the other rows' count
        s0 = time.perf_counter()
        rows = np.arange(k * cfg.shard_size, min((k + 1) * cfg.shard_size, len(order)))
        shard = generate_shard(engine, prompts, order, rows, width, cfg, stop_token, target_cfg.vocab_size)
        spent.append(time.perf_counter() - s0)
        shard.update(key=kid, seconds=spent[-1], slots=engine.slots, policy=cfg.policy)
        with atomic_io.temporary_file(shard_path(out_dir, k)) as tmp, open(tmp, "wb") as f:
            np.savez(f, **shard)
        written += 1
        bar.update(1)
        new = int(np.sum(shard["ends"] - shard["starts"]))
        bar.write(f"shard {k}: {len(rows)} replies, {new} tokens in {spent[-1]:.1f} s ({new / spent[-1]:.0f} "
                  f"tokens/s, {shard['engine_steps']} engine steps, {shard['stopped'].mean():.0%} ended at the "
                  f"stop token)")
    bar.close()
    done = sum(_shard_id(shard_path(out_dir, k)) == kid for k in range(total))
    return RepliesProgress(done=done, total=total, written=written, seconds=time.perf_counter() - t0)


def load_replies(out_dir: str | Path, num_replies: int | None = None) -> tuple[Sequences, dict]:
    """Every reply of the first `num_replies` (None: every shard the folder has, in order) as Sequences, and
    the manifest with `sources` (prompts.json, None if absent) and `shards`. Shards missing are an error."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST
    if not path.exists():
        raise RepliesError(f"no replies in {out_dir} (no {MANIFEST}); generate them first (stage=replies)")
    manifest = json.loads(path.read_text())
    key, kid = manifest["key"], manifest["id"]
    available = key["prompts"]["count"] * len(key["temperatures"])
    if num_replies is None:
        total = 0
        while shard_path(out_dir, total).exists():
            total += 1
    else:
        total = num_shards(num_replies, key["shard_size"], available)
    parts, missing = [], []
    for k in range(total):
        def load(p: Path) -> dict:
            with np.load(p) as data:
                if str(data["key"]) != kid:
                    raise RepliesError(f"{p} was written for other settings than {path}")
                return {name: data[name] for name in ("tokens", "starts", "ends", "prompt_index",
                                                      "temperature")}
        part = atomic_io.read_cache(shard_path(out_dir, k), load, "a replies shard")
        (missing.append(k) if part is None else parts.append(part))
    if missing or not parts:
        raise RepliesError(f"{out_dir} holds {total - len(missing)} of the {total} shards asked for "
                           f"(missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}); run stage=replies "
                           f"again to write them (each run continues where the last stopped)")
    seqs = Sequences(np.concatenate([p["tokens"] for p in parts]).astype(np.int32),
                     np.concatenate([p["starts"] for p in parts]), np.concatenate([p["ends"] for p in parts]))
    sources = json.loads((out_dir / SOURCES).read_text()) if (out_dir / SOURCES).exists() else None
    info = dict(manifest, sources=sources, shards=total,
                prompt_index=np.concatenate([p["prompt_index"] for p in parts]),
                temperature=np.concatenate([p["temperature"] for p in parts]))
    return seqs, info
