"""Checks of a run config against the files it names: an oracle drafter's step and confidence traces,
the target's tokenizer and chat template for text prompts, its end-of-sequence token. Each raises
ConfigValueError naming the key (called by `config_schema.validate`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specpilot.data import prompt_sets
from specpilot.harness.config_errors import fail as _fail
from specpilot.models.confidence_trace import load_calibration
from specpilot.models.oracle_trace import load_model, load_traces, model_shape, trace_method, trace_path


def check_step_trace(plan, step_trace) -> None:
    """A plan an oracle_trace drafter can run: its trace recorded under its name, else one the file's
    acceptance model can sample for its shape."""
    if trace_method(plan.name) in load_traces(step_trace):
        return
    model = load_model(step_trace)
    if model is None:
        _fail("drafter.step_trace", f"plan {plan.name!r} has no trace in {step_trace} and the file holds no "
              f"acceptance model to sample one (traces are per plan name: "
              f"{', '.join(sorted(load_traces(step_trace)))})")
    try:
        model_shape(plan, model.depth)
    except ValueError as e:
        _fail("drafter.step_trace", str(e))


def check_confidence_trace(d) -> None:
    if d.source != "oracle":
        _fail("drafter.confidence_trace", f"a recorded confidence calibrates an oracle drafter; source is "
              f"{d.source!r}")
    if not trace_path(d.confidence_trace).is_file():
        _fail("drafter.confidence_trace", f"no trace file at {d.confidence_trace}")
    try:
        load_calibration(d.confidence_trace, d.confidence_method)
    except (ValueError, KeyError, TypeError) as e:
        _fail("drafter.confidence_trace", " ".join(str(e).split()))


def check_text_prompts(t: DictConfig, b: DictConfig) -> None:
    """A text prompt set needs the target's tokenizer, and a chat one its chat template (GGUF files are
    checked once converted, when the deployment is built)."""
    if b.prompts not in prompt_sets.TEXT_SETS:
        return
    chat = b.prompts in prompt_sets.CHAT_SETS
    if t.source == "random":
        _fail("bench.prompts", f"{b.prompts!r} prompts are text and need the target's tokenizer; the random-weight "
              f"target {t.name!r} has none (use bench.prompts=random, or a target with one: hf, gguf, smollm2)")
    if t.source == "embedded" and chat:
        _fail("bench.prompts", f"{b.prompts!r} prompts are chats; the embedded target has no chat template "
              "(use bench.prompts=humaneval or heldout)")
    if t.source == "hf":
        path = Path(str(t.path)).expanduser()
        if not prompt_sets.has_tokenizer(path):
            _fail("bench.prompts", f"{b.prompts!r} prompts need the target's tokenizer; no tokenizer.json in {path}")
        if chat and not prompt_sets.chat_template(path):
            _fail("bench.prompts", f"{b.prompts!r} prompts are chats; {path} has no chat template")


def check_stop(t: DictConfig, b: DictConfig) -> None:
    """bench.stop_at_eos needs a target with a tokenizer naming its end-of-sequence token."""
    if b.stop_at_eos and t.source == "random":
        _fail("bench.stop_at_eos", "a random-weight target has no tokenizer, so no end-of-sequence token; "
              "use a target with one (hf, gguf, smollm2, embedded) or bench.stop_at_eos=false")
    if b.stop_at_eos and t.source == "hf":
        if prompt_sets.eos_token_id(Path(str(t.path)).expanduser()) is None:
            _fail("bench.stop_at_eos", f"the checkpoint at {t.path} names no end-of-sequence token (no "
                  "tokenizer.json / tokenizer_config.json eos_token, no config.json eos_token_id)")
