"""A deployment: target (+ drafter), sampling, prompts and cache size, built from a composed config.

Design choices:
- Everything a method needs is in one `Deployment` value; methods never read the config themselves.
- Random-weight targets are built at their real shape directly on the device, and the deployment
  carries notes ("random weights", "oracle acceptance") that every result record repeats.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import DictConfig, OmegaConf

from specpilot.decoding.sampling import SamplingConfig
from specpilot.models import dense
from specpilot.models.config import ModelConfig, default_tap_layers

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass
class Deployment:
    params: Any
    cfg: ModelConfig
    sampling: SamplingConfig
    prompts: list[list[int]]
    batch_size: int
    new_tokens: int
    cache_len: int
    key: jax.Array
    drafter: Any = None  # (drafter object, drafter params) or None
    block_size: int = 1
    profile_split: bool = False  # speculative methods add a profiled pass for the time split
    notes: list[str] = dataclasses.field(default_factory=list)
    # the AR baseline's output tokens per prompt, filled by the runner (an oracle drafter replays them)
    reference_tokens: list[list[int]] | None = None
    labels: dict = dataclasses.field(default_factory=dict)
    encoded_params: dict = dataclasses.field(default_factory=dict, repr=False)  # format -> params
    kernel_backend: str = "xla"  # gpu.kernel_backend: what multiplies weights in a non-bf16 format

    def _encode(self, key: str, params, fmt: str, **kw):
        """params in weight format `fmt`, encoded once per deployment under `key` (offline work)."""
        from specpilot import formats

        if key not in self.encoded_params:
            kernel = {"triton": "pallas", "xla": "xla", "mosaic": "mosaic"}[self.kernel_backend]
            rows = self.batch_size * self.block_size  # the most rows a decoding step's products take
            self.encoded_params[key] = formats.encode_params(params, fmt, kernel=kernel, rows=rows, **kw)
        return self.encoded_params[key]

    def encoded(self, fmt: str):
        """The target's params in weight format `fmt`."""
        return self._encode(fmt, self.params, fmt)

    def twin(self):
        """The target's bf16 params tiled once for the Mosaic W12 kernel's bf16 twin (`w12.twin_params`):
        the same bits as `params`, multiplied by a bf16 kernel with W12's structure (the best bf16 path
        at decode shapes on the H200, docs/performance.md)."""
        if self.kernel_backend != "mosaic":
            raise ValueError("the bf16 twin is the Mosaic GPU kernel's; set gpu.kernel_backend=mosaic")
        if "twin" not in self.encoded_params:
            from specpilot.formats import w12

            self.encoded_params["twin"] = w12.twin_params(self.params)
        return self.encoded_params["twin"]

    def encoded_drafter(self, fmt: str):
        """The drafter's own weights (its layers and `fc`; embedding and head are the target's) in
        format `fmt`. For an oracle drafter, those of the drafter it runs."""
        return self._encode("drafter:" + fmt, self.drafter[1], fmt, extra=("fc",))

    def batches(self) -> list[list[list[int]]]:
        """Prompts grouped into batches of `batch_size` (a trailing partial batch is dropped)."""
        n = len(self.prompts) // self.batch_size * self.batch_size
        return [self.prompts[i:i + self.batch_size] for i in range(0, n, self.batch_size)]


def target_tap_layers(tconf: DictConfig, dconf: DictConfig, num_layers: int) -> tuple[int, ...]:
    if tconf.get("tap_layers"):
        return tuple(int(t) for t in tconf.tap_layers)
    if dconf.source == "none":
        return ()
    return default_tap_layers(num_layers, int(dconf.num_taps))


def build_target(tconf: DictConfig, dconf: DictConfig, seed: int):
    """-> (params, ModelConfig, notes)."""
    dtype = DTYPES[tconf.dtype]
    if tconf.source == "random":
        hf = OmegaConf.to_container(tconf.model, resolve=True)
        cfg = ModelConfig.from_hf_dict(hf)
        cfg = cfg.with_taps(target_tap_layers(tconf, dconf, cfg.num_layers))
        params = dense.INITS[tconf.init](jax.random.key(seed), cfg, dtype=dtype, std=float(tconf.init_std))
        return params, cfg, [f"random weights ({tconf.name} shape, {tconf.init} init)"]
    if tconf.source == "hf":
        from specpilot.models.checkpoint import load_hf

        path = Path(str(tconf.path)).expanduser()
        params, cfg = load_hf(path, dtype=dtype)
        cfg = cfg.with_taps(target_tap_layers(tconf, dconf, cfg.num_layers))
        return params, cfg, []
    raise ValueError(f"unknown target source {tconf.source!r}")


def build_drafter(dconf: DictConfig, target_cfg: ModelConfig, target_params, seed: int):
    """-> (drafter object, drafter params, target config with the drafter's taps, notes)."""
    from specpilot.models import drafter as dr

    dtype = target_params["embed"].dtype
    if dconf.source == "oracle":
        from specpilot.models.oracle import OracleDrafter, conditional_profile, expected_tau

        inner, params, target_cfg, _ = build_drafter(
            OmegaConf.merge(dconf, {"source": "random"}), target_cfg, target_params, seed)
        acceptance, source = dconf.acceptance, "profile"
        if dconf.get("acceptance_trace"):
            from specpilot.models.oracle import load_trace

            acceptance, source = load_trace(dconf.acceptance_trace), f"trace {dconf.acceptance_trace}"
        profile = conditional_profile(int(dconf.block_size), acceptance, dconf.tau)
        note = (f"oracle acceptance ({source} with expected tau {expected_tau(profile):.2f}; real "
                f"drafter forward at its shape, drafts replay the target's greedy continuation)")
        return OracleDrafter(inner, tuple(float(c) for c in profile)), params, target_cfg, [note]
    if dconf.source == "random":
        dcfg = dr.DrafterConfig.for_target(target_cfg, num_layers=int(dconf.num_layers),
                                           block_size=int(dconf.block_size),
                                           num_taps=int(dconf.num_taps))
        params = dr.init(jax.random.key(seed + 7), dcfg, dtype=dtype)
        notes = ["random drafter weights"]
    elif dconf.source == "dflash":
        params, dcfg = dr.load_drafter(Path(str(dconf.path)).expanduser(), dtype=dtype)
        dcfg = dataclasses.replace(dcfg, block_size=int(dconf.block_size))
        notes = []
    else:
        raise NotImplementedError(f"drafter source {dconf.source!r} is not available yet")
    target_cfg = target_cfg.with_taps(dcfg.tap_layers)
    return dr.BlockDrafter(dcfg, target_cfg), params, target_cfg, notes


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(n, length)).tolist()


def build_embedded(cfg: DictConfig):
    """-> (params, cfg, drafter or None, held-out prompts, notes) of the locally trained pair."""
    from specpilot import embedded
    from specpilot.models import drafter as dr

    econf = embedded.from_overrides(OmegaConf.to_container(cfg.embedded, resolve=True))
    pair = embedded.ensure_pair(cfg.cache_dir, econf, dtype=DTYPES[cfg.target.dtype])
    drafter = None
    if cfg.drafter.source == "embedded":
        dcfg = dataclasses.replace(pair.drafter_cfg, block_size=int(cfg.drafter.block_size))
        drafter = (dr.BlockDrafter(dcfg, pair.target_cfg), pair.drafter_params)
    notes = [f"embedded pair trained here ({pair.directory.name}; drafter trained at block "
             f"{pair.drafter_cfg.block_size})"]
    return pair.target_params, pair.target_cfg, drafter, pair.prompts.as_lists(), notes


def build(cfg: DictConfig) -> Deployment:
    b, dec = cfg.bench, cfg.decoding
    drafter, heldout = None, None
    if cfg.target.source == "embedded":
        params, mcfg, drafter, heldout, notes = build_embedded(cfg)
    else:
        params, mcfg, notes = build_target(cfg.target, cfg.drafter, int(cfg.seed))
    if cfg.drafter.source not in ("none", "embedded"):
        drafter_obj, draft_params, mcfg, dnotes = build_drafter(cfg.drafter, mcfg, params, int(cfg.seed))
        drafter = (drafter_obj, draft_params)
        notes = notes + dnotes
    if cfg.target.layout == "fused":
        params = dense.fuse_projections(params)
    if b.prompts == "random":
        prompts = random_prompts(b.num_prompts, b.prompt_len, mcfg.vocab_size, int(cfg.seed) + 1)
    else:
        if len(heldout) < b.num_prompts:
            raise ValueError(f"bench.num_prompts={b.num_prompts} but the embedded set has {len(heldout)} "
                             f"held-out prompts (embedded.num_prompts)")
        prompts = [p[-b.prompt_len:] for p in heldout[: b.num_prompts]]  # keep each prompt's end
    longest = max(len(p) for p in prompts)
    block = int(cfg.drafter.block_size) if cfg.drafter.source != "none" else 1
    cache_len = b.cache_len or -(-(longest + b.new_tokens + block) // 128) * 128
    labels = {"target": cfg.target.name, "drafter": cfg.drafter.name, "gpu": cfg.gpu.name,
              "block_size": block if cfg.drafter.source != "none" else None,
              "batch_size": int(b.batch_size), "prompts": b.prompts, "new_tokens": int(b.new_tokens)}
    return Deployment(
        params=params, cfg=mcfg,
        sampling=SamplingConfig(float(dec.temperature), int(dec.top_k), float(dec.top_p)),
        prompts=prompts, batch_size=int(b.batch_size), new_tokens=int(b.new_tokens),
        cache_len=int(cache_len), key=jax.random.key(int(cfg.seed)), drafter=drafter,
        block_size=block, profile_split=bool(dec.profile_split), notes=notes, labels=labels,
        kernel_backend=str(cfg.gpu.kernel_backend))
