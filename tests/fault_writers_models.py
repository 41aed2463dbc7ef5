"""Fault-injection scenarios for the writers of weights and training state (each child imports jax): a
drafter folder, regenerated drafter data, a model folder, a Hugging Face export and a resumable training
run, each read back (or resumed) as a later run does."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from fault_hooks import Scenario, main

from specpilot import atomic_io
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import export_hf, load_model, save_model
from specpilot.training.common import JsonlLog, run_training
from specpilot.training.drafter import Sequences, load_sequences, save_sequences

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, qk_norm=True, eos_token_id=1)


def _arrays(tree) -> list:
    return [np.asarray(x).tolist() for x in jax.tree.leaves(tree)]


def _target(version):
    return dense.init(jax.random.key(version), CFG, dtype=jnp.float32, std=0.5)


class Drafter(Scenario):
    output = "drafter"

    def _params(self, version):
        dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=4)
        return dr.init(jax.random.key(version), dcfg, jnp.float32), dcfg

    def write(self, folder, version):
        dr.save_drafter(folder / "drafter", *self._params(version))

    def read(self, folder, version):
        got = atomic_io.read_cache(folder / "drafter", dr.load_drafter, "drafter")
        if got is None:
            self.write(folder, version)
            got = dr.load_drafter(folder / "drafter")
        return _arrays(got[0])

    def expected(self, folder, version):
        return _arrays(self._params(version)[0])


class Regenerated(Scenario):
    output = "regenerated.npz"

    def _sequences(self, version):
        tokens = (np.arange(256 * 200, dtype=np.int32).reshape(256, 200) + version) % 64
        return Sequences(tokens, np.full(256, 96, np.int32), np.full(256, 200, np.int32))

    def write(self, folder, version):
        s = self._sequences(version)
        save_sequences(folder / "regenerated.npz", f"v{version}", s, s.rows(slice(0, 8)), seconds=1.0)

    def read(self, folder, version):
        got = load_sequences(folder / "regenerated.npz", f"v{version}")
        if got is None:  # absent, unreadable (removed with a warning) or an older version's: regenerate
            self.write(folder, version)
            got = load_sequences(folder / "regenerated.npz", f"v{version}")
        return got[0].tokens.tolist(), got[1].tokens.tolist()

    def expected(self, folder, version):
        s = self._sequences(version)
        return s.tokens.tolist(), s.tokens[:8].tolist()


class Model(Scenario):
    output = "model"

    def write(self, folder, version):
        save_model(folder / "model", _target(version), CFG, extra={"version": version})

    def read(self, folder, version):
        got = atomic_io.read_cache(folder / "model", load_model, "model folder")
        if got is None:
            self.write(folder, version)
            got = load_model(folder / "model")
        return _arrays(got[0])

    def expected(self, folder, version):
        return _arrays(_target(version))


class Export(Scenario):
    output = "hf"

    def prepare(self, folder, version):
        save_model(folder / f"source{version}", _target(version), CFG)

    def write(self, folder, version):
        export_hf(folder / f"source{version}", folder / "hf", max_shard_bytes=20_000)

    def read(self, folder, version):
        got = atomic_io.read_cache(folder / "hf", lambda p: load_hf(p, dtype=None), "export")
        if got is None:
            self.write(folder, version)
            got = load_hf(folder / "hf", dtype=None)
        return _arrays(got[0])

    def expected(self, folder, version):
        return _arrays(_target(version))


class Training(Scenario):
    """A resumable run of 8 steps with a checkpoint after each: killed anywhere, the next run resumes and
    ends where an uninterrupted run ends, with each step logged once."""

    output = "run"

    STEPS = 8

    def _run(self, folder, version):
        state = {"w": jnp.arange(4096.0), "step": jnp.zeros((), jnp.int32)}

        def step_fn(state, batch):
            return {"w": state["w"] * 0.5 + batch, "step": state["step"] + 1}, {"loss": state["w"].sum()}

        final, _ = run_training(state, step_fn, lambda step: jnp.float32(step + version), steps=self.STEPS,
                                out_dir=folder / "run", meta={"version": version}, log_every=1,
                                checkpoint_every=1, progress=False)
        return final

    def write(self, folder, version):
        self._run(folder, version)

    def read(self, folder, version):
        final = self._run(folder, version)
        steps = [r["step"] for r in JsonlLog(folder / "run" / "log.jsonl").read()]
        return _arrays(final), steps

    def expected(self, folder, version):
        return self.read(Path(folder) / "uninterrupted", version)


SCENARIOS = {"drafter": Drafter(), "regenerated": Regenerated(), "model": Model(), "export": Export(),
             "training": Training()}

if __name__ == "__main__":
    main(SCENARIOS)
