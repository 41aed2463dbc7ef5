"""Fault-injection scenarios for the writers that need no jax (a child starts in well under a second): a
JSON record, a prompt set and a tokenizer, each read back as a later run reads it."""

from __future__ import annotations

import json

import numpy as np
from fault_hooks import Scenario, main

from specpilot import atomic_io
from specpilot.data.prompts import PromptSet
from specpilot.data.tokenizer import load_tokenizer, train_tokenizer


class JsonRecord(Scenario):
    output = "record.json"

    def _value(self, version):
        return {"version": version, "rows": [[version] * 64] * 256}

    def write(self, folder, version):
        atomic_io.write_json(folder / "record.json", self._value(version))

    def read(self, folder, version):
        got = atomic_io.read_cache(folder / "record.json", lambda p: json.loads(p.read_text()), "record")
        if got is None:
            self.write(folder, version)
            got = json.loads((folder / "record.json").read_text())
        return got

    def expected(self, folder, version):
        return self._value(version)


class Prompts(Scenario):
    output = "prompts.json"

    def _prompts(self, version):
        return PromptSet(np.full((64, 96), version, np.int32), np.full((64, 128), -version, np.int32),
                         tuple(f"file{i}.py:{version}" for i in range(64)))

    def write(self, folder, version):
        self._prompts(version).save(folder / "prompts.json")

    def read(self, folder, version):
        got = atomic_io.read_cache(folder / "prompts.json", PromptSet.load, "prompt set")
        if got is None:
            got = PromptSet.load(self._prompts(version).save(folder / "prompts.json"))
        return got.tokens.tolist(), got.continuations.tolist(), got.sources

    def expected(self, folder, version):
        p = self._prompts(version)
        return p.tokens.tolist(), p.continuations.tolist(), p.sources


class Tokenizer(Scenario):
    output = "tokenizer.json"

    def _tokenizer(self, version):
        text = "".join(f"def f{i}(x):\n    return x * {i + version}\n" for i in range(200))
        return train_tokenizer([text], vocab_size=320 + version)

    def write(self, folder, version):
        self._tokenizer(version).save(folder / "tokenizer.json")

    def read(self, folder, version):
        got = atomic_io.read_cache(folder / "tokenizer.json", load_tokenizer, "tokenizer")
        if got is None:
            got = load_tokenizer(self._tokenizer(version).save(folder / "tokenizer.json"))
        return got.tokenizer.to_str()

    def expected(self, folder, version):
        return self._tokenizer(version).tokenizer.to_str()


SCENARIOS = {"json": JsonRecord(), "prompts": Prompts(), "tokenizer": Tokenizer()}

if __name__ == "__main__":
    main(SCENARIOS)
