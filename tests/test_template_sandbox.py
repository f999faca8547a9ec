"""Hostile templates (chat templates in tokenizer_config.json, chat_template.jinja, task files):
each ends in one error line naming the file and the reason, within the limits of
mff.data.jinja_sandbox, and real templates still render as before."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from mff.data import jinja_sandbox
from mff.data.chat import TemplateRenderError, render_chat_template
from tests.cli_util import ROOT, cli_env
from tests.sft_util import make_chat_checkpoint, run_finetune, write_rows

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

HOSTILE = {
    "sandbox escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "tried something the sandbox forbids"),
    "raise_exception": ("{{ raise_exception('Only user and assistant roles are supported!') }}",
                        "raised an error: Only user and assistant roles are supported!"),
    "nested loops": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                     "the loops ran more than 1,000,000 iterations"),
    "gigabytes of output": ("{% for i in range(99999) %}{% for j in range(9) %}{{ 'x' * 999999 }}{% endfor %}{% endfor %}",
                            "the rendered text passes 4,000,000 characters"),
    "string repetition": ("{{ 'x' * 10**9 }}", "str of length 1 * 1000000000"),
    "percent width": ("{{ '%999999999d' % 1 }}", "format width 999999999"),
    "format filter width": ("{{ '%999999999d' | format(1) }}", "format width 999999999"),
    "str.format width": ("{{ '{:{}}'.format(1, 10**9) }}", "str.format width 1000000000"),
    "center": ("{{ 'x' | center(10**9) }}", "center(1000000000)"),
    "replace": ("{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}", "str.replace would make 10,000,000,000 characters"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                 "a str of 4,194,304 items"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "more than 1,000,000 calls"),
    "runaway recursion": ("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", "RecursionError"),
    "syntax": ("{% for m in messages %}", "does not parse (line 1)"),
    # sizes multiplied inside a filter, a method or a constant jinja2 would fold at compile time
    "format filter, named width": ('{{ "%(a)2000000000s" | format(a="x") }}', "format width 2000000000"),
    "percent, named width": ('{{ "%(a)2000000000s" % {"a": "x"} }}', "format width 2000000000"),
    "percent, star width": ('{{ "%*s" % (2000000000, "x") }}', "format width 2000000000 (from *)"),
    "str.format width from an item": ('{{ "{1:{0[0]}}".format([2000000000], "x") }}', "str.format width 2000000000"),
    "str.format width from a string": ('{{ "{0:{1}}".format("x", "2000000000") }}', "str.format width 2000000000"),
    "format_map width": ('{{ "{a:{w}}".format_map({"a": "x", "w": 2000000000}) }}', "str.format width 2000000000"),
    "bytes repetition": ("{{ 'a'.encode('utf-8') * 2000000000 }}", "bytes of length 1 * 2000000000"),
    "integer squaring": ("{% set ns = namespace(x=2**2000) %}{% for i in range(22) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
                         "an integer * an integer passes 4096 bits"),
    "replace filter": ("{{ ('a' * 4000000) | replace('a', 'a' * 1000) }}", "replace would make 4,000,000,000 characters"),
    "join filter": ("{{ range(1000) | join('a' * 4000000) }}", "join would make 3,996,00"),
    "str.join of a generator": ("{{ ('a' * 4000000).join(range(1000) | map('string')) }}", "str.join would make"),
    "str.translate": ("{{ ('a' * 5000).translate({97: 'b' * 1000}) }}", "str.translate would make 5,000,000 characters"),
    "batch fill": ('{{ [1] | batch(1000000000, "x") | list }}', "batch(1000000000) with a fill value"),
    "slice": ("{{ [1] | slice(1000000000) | list }}", "slice(1000000000)"),
    "wordwrap output": ("{{ ('a ' * 1000) | wordwrap(1, wrapstring='x' * 4000000) }}", "wordwrap(1) would make"),
    "wordwrap of one long word": ("{{ ('a' * 2000000) | wordwrap(1, wrapstring='') }}", "2,000,000-character word would copy"),
    "tojson indent": ("{{ range(1000) | list | tojson(indent=4000000) }}", "tojson(indent=4000000) would make"),
    "lipsum": ("{{ lipsum(3000000, html=false) }}", "lipsum(3000000) would make"),
    "list nested in itself": ("{% set ns = namespace(l=[]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
                              "a list holding more than 4,000,000 items and characters"),
    "dict nested in itself": ('{% set ns = namespace(l={}) %}{% for i in range(40) %}{% set ns.l = {"a": ns.l, "b": ns.l} %}'
                              "{% endfor %}{{ ns.l | tojson }}", "a dict holding more than 4,000,000 items"),
    "list of a big string repeated": ("{% set s = 'x' * 3999999 %}{{ ([s] * 1000) | length }}", "a list of length 1 * 1000 would make"),
    "dict.fromkeys of a big string": ("{% set s = 'x' * 3999999 %}{{ dict.fromkeys(range(1000), s) | length }}", "a dict holding more"),
    "text written in a set block": ("{% set s = 'x' * 3999999 %}{% set b %}{% for i in range(5000) %}{{ s }}{% endfor %}{% endset %}",
                                    "the rendered text passes 4,000,000 characters"),
    "tojson separators": ('{% set s = "x" * 3900000 %}{{ ([0] * 1000) | tojson(separators=(s, ":")) }}', "separators of 3900001 characters"),
    "int.to_bytes": ('{{ (1).to_bytes(3000000000, "big") }}', "int.to_bytes(3000000000) would make"),
    "str.translate of a list": ('{% set t = [""] * 97 + ["x" * 3900000] %}{{ ("a" * 700).translate(t) }}', "str.translate would make"),
    "percent, nested key": ('{{ "%((a))3000000000s" % {"(a)": "x"} }}', "format width 3000000000"),
    "percent on bytes": ('{{ "%3000000000s".encode() % ("x".encode(),) }}', "format width 3000000000"),
    "list of big integers": ("{% set n = 2 ** 2000 %}{{ ([n] * 3000000) | join }}", "a list of length 1 * 3000000 would make"),
    "big integer from a string": ('{% set n = ("9" * 4000) | int %}', "an integer of 13,288 bits passes 4096 bits"),
    "3,000 chained +": ("{{ " + " + ".join(["1"] * 3000) + " }}", "nests too deeply to compile (RecursionError)"),
    "120 nested ifs": ("{% if 1 %}" * 120 + "x" + "{% endif %}" * 120, "nests too deeply to compile (IndentationError)"),
    "a newline in an error": ('{{ "x".encode("a\nb") }}', "unknown encoding: a b"),
    "text written in a macro": ("{% macro m() %}" + "y" * 1000 + "{% endmacro %}{% for i in range(100000) %}{% set _ = m() %}{% endfor %}",
                                "the rendered text passes 4,000,000 characters"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_one_error_line_within_the_limits(name, monkeypatch):
    # each case's own limit must stop it, not the 10 s clock on a loaded machine (the time limit has its own test)
    monkeypatch.setattr(jinja_sandbox, "MAX_RENDER_SECONDS", 60.0)
    template, reason = HOSTILE[name]
    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError) as e:
        render_chat_template(template, MESSAGES, what="the chat template of x/tokenizer_config.json")
    msg = str(e.value)
    assert msg.startswith("the chat template of x/tokenizer_config.json ") and reason in msg and "\n" not in msg, msg
    assert time.monotonic() - t0 < jinja_sandbox.MAX_RENDER_SECONDS + 5


def test_the_time_limit_stops_a_slow_render(monkeypatch):
    monkeypatch.setattr(jinja_sandbox, "MAX_RENDER_SECONDS", 0.2)
    monkeypatch.setattr(jinja_sandbox, "MAX_LOOP_ITERATIONS", 10**12)
    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError, match="ran past 0.2 s"):
        render_chat_template("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", MESSAGES)
    assert time.monotonic() - t0 < 5
    # one |list pulling a chain of lazy filters over 4,000,000 items is one call: the clock is read inside it
    t0 = time.monotonic()
    with pytest.raises(TemplateRenderError, match="ran past 0.2 s"):
        render_chat_template('{{ ([0] * 4000000)' + '|map("string")|map("int")' * 5 + '|list|length }}', MESSAGES)
    assert time.monotonic() - t0 < 5


def test_adding_many_lists_is_linear_and_a_namespace_may_hold_itself():
    # sum(start=[]) of 100,000 lists: Python's sum copies the running total each time (quadratic)
    t0 = time.monotonic()
    out = render_chat_template("{{ (range(100000) | map('string') | map('list') | list) | sum(start=[]) | length }}"
                               "{% set ns = namespace() %}{% set ns.me = ns %}{{ [ns, ns] | length }}", MESSAGES)
    assert out == "4888902" and time.monotonic() - t0 < 30  # linear: ~1 s; quadratic copying would take minutes


def test_templates_real_models_use_still_render():
    # ChatML as Qwen writes it: namespace, loop.last, filters, the block tags {% set %} / {% filter %}
    chatml = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
              "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | trim + '<|im_end|>' + '\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}{% filter upper %}{{ ns.n }}x{% endfilter %}"
              "{{ messages | tojson }}{{ '%s-%d' | format('a', 3) }}{{ 'ab' | center(6) }}{{ '{}+{}'.format(1, 2) }}")
    out = render_chat_template(chatml, MESSAGES)
    assert out == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n2X"
                   + json.dumps(MESSAGES) + "a-3  ab  1+2")
    # a long conversation inside the limits renders whole
    long = [{"role": "user", "content": "y" * 1_000_000}] * 3
    assert len(render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", long)) == 3_000_000


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("base") / "qwen3")


def _with_template(base, tmp_path, template: str, as_file: bool = False):
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    if as_file:
        del cfg["chat_template"]
        (folder / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _one_error_line(r, *needles):
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("name", ["sandbox escape", "raise_exception", "gigabytes of output"])
def test_generate_names_the_template_file_and_the_reason(base, tmp_path, name):
    template, reason = HOSTILE[name]
    as_file = name == "gigabytes of output"
    folder = _with_template(base, tmp_path, template, as_file=as_file)
    r = subprocess.run([sys.executable, "-m", "mff.recipes.generate", "--ckpt", str(folder), "--chat", "--prompt", "hi",
                        "--max-new-tokens", "2", "--threads", "1"], capture_output=True, text=True, env=cli_env(tmp_path), cwd=ROOT)
    where = folder / "chat_template.jinja" if as_file else f"{folder / 'tokenizer_config.json'} chat_template"
    _one_error_line(r, f"the chat template of {where}", reason)


def test_finetune_names_the_template_file_the_row_and_the_reason(base, tmp_path):
    template = "{% if messages[0]['role'] == 'user' %}{{ raise_exception('no system turn') }}{% endif %}"
    folder = _with_template(base, tmp_path, template)
    rows = write_rows(tmp_path / "chat.jsonl", 4)
    r = run_finetune(["--init-from", str(folder), "--data.path", str(rows), "--ckpt-dir", str(tmp_path / "run"), "--steps", "1",
                      "--seq-len", "64", "--batch-size", "2", "--threads", "1"], tmp_path)
    _one_error_line(r, str(rows), f"the chat template of {folder / 'tokenizer_config.json'} chat_template raised an error: no system turn")
    assert not (tmp_path / "run").exists()


def test_a_list_of_named_templates_without_default_is_named(base, tmp_path):
    from mff.ckpt.tokenizer_files import load_text_assets

    folder = _with_template(base, tmp_path, "x")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "{{ 1 }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: chat_template is a list of named templates without one named 'default'"):
        load_text_assets(folder)
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match=r"chat_template.jinja is not UTF-8 text \(byte 0"):
        load_text_assets(folder)


def test_a_task_file_template_is_bounded(tmp_path):
    from mff.eval.taskfile import TaskFileError, read_task_file

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "2+2", "a": "4"}) + "\n")
    task = tmp_path / "t.yaml"
    task.write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
                    "output_type: generate_until\ndoc_to_text: \"{{ q * 10**9 }}\"\ndoc_to_target: a\n")
    with pytest.raises(TaskFileError, match=r"doc_to_text template .* went past a limit: a str of length 3 \* 1000000000"):
        read_task_file(task).load()
