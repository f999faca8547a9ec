"""A conversation -> token ids and the mask of the tokens trained on (the assistant's answers).

Two ways to turn messages into text:

- :class:`ChatTemplateEncoder`: the checkpoint's chat template (:func:`mff.data.chat.render_chat_template`,
  as HF's ``apply_chat_template``). The conversation is rendered whole, and once per assistant
  turn up to it: ``messages[:i]`` with the generation prompt gives where answer i starts,
  ``messages[:i + 1]`` where it ends (the trailing whitespace after the turn's last special
  token, e.g. ChatML's ``"\\n"`` after ``<|im_end|>``, is left to the next turn). Each rendering
  must be a prefix of the whole one. The boundaries are then checked on tokens: the tokens of
  the text up to a boundary must be a prefix of the whole text's tokens. Where a tokenizer merges
  characters across a boundary into one token, the conversation is instead encoded piece by
  piece (each piece between two boundaries on its own, as an inference prompt would be encoded)
  and the merge is counted; the mask never shifts.
- :class:`MindFormersAlpacaEncoder`: MindFormers' ``AlpacaInstructDataHandler``: the text
  ``"{system} " + "USER: {prompt} " + "ASSISTANT: {output}</s>"``, each part tokenized on its
  own, the loss on the whole assistant part (its ``ASSISTANT: `` prefix and the literal ``</s>``
  text included), with MindFormers' fixed system sentence and Stanford Alpaca prompts.

``train_on``: ``assistant`` (every answer), ``last`` (the final answer only; for templates that
render earlier turns differently, e.g. dropping their reasoning) or ``all`` (every token).
Token ids are encoded without the tokenizer's post-processor specials (the template writes
BOS/EOS itself), as ``apply_chat_template(tokenize=True)`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from mff.data.chat import render_chat_template

__all__ = ["TRAIN_ON", "Encoded", "ChatTemplateEncoder", "MindFormersAlpacaEncoder"]

TRAIN_ON = ("assistant", "last", "all")


@dataclass
class Encoded:
    """``ids`` (int list) and ``mask`` (bool list, same length: True = a token trained on, as a
    target); ``merges``: boundaries where the tokenizer merged across the join."""

    ids: list[int]
    mask: list[bool]
    merges: int = 0


class ChatTemplateEncoder:
    """Encode conversations with a chat template (see the module docstring).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        template: the Jinja chat template.
        bos_token, eos_token: the template variables of the same names ("" when unknown).
        train_on: one of :data:`TRAIN_ON`.
    """

    def __init__(self, tokenizer, template: str, bos_token: str | None = None, eos_token: str | None = None, train_on: str = "assistant",
                 what: str = "the chat template"):
        if train_on not in TRAIN_ON:
            raise ValueError(f"--data.train-on {train_on!r}; expected one of {', '.join(TRAIN_ON)}")
        self.tok = tokenizer
        self.template = template
        self.vars = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        self.train_on = train_on
        self.what = what
        self.specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content),
                               key=len, reverse=True)

    def _render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        return render_chat_template(self.template, messages, add_generation_prompt=add_generation_prompt, what=f"{where}: {self.what}",
                                    **self.vars)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _answer_end(self, text: str, start: int, end: int) -> int:
        """End of the answer span ``text[start:end]``: after the last special token when only
        whitespace follows it."""
        stripped = text[start:end].rstrip()
        for s in self.specials:
            if stripped.endswith(s):
                return start + len(stripped)
        return end

    def spans(self, messages: list[dict], where: str = "row") -> tuple[str, list[tuple[int, int]]]:
        """The whole rendered text and the character spans ``[start, end)`` trained on.

        Raises:
            ValueError: the template renders a turn differently inside the whole conversation
                (names the turn; ``--data.train-on last`` avoids it), or fails (its message).
        """
        full = self._render(messages, False, where)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.train_on == "last":
            turns = turns[-1:]
        if self.train_on == "all":
            return full, [(0, len(full))]
        out = []
        for i in turns:
            before = self._render(messages[:i], True, where)
            upto = self._render(messages[: i + 1], False, where)
            for part, what in ((before, "the prompt before"), (upto, "the conversation through")):
                if not full.startswith(part):
                    raise ValueError(f"{where}: the chat template renders {what} assistant turn {i} differently from the whole "
                                     "conversation (it rewrites earlier turns); train on the final answer only with --data.train-on last")
            out.append((len(before), self._answer_end(full, len(before), len(upto))))
        return full, out

    def encode(self, messages: list[dict], where: str = "row") -> Encoded:
        """Token ids and the trained-token mask of ``messages``. Raises as :meth:`spans`, and
        ValueError when the tokenizer cannot encode the text."""
        try:
            return self._encode_checked(messages, where)
        except Exception as e:  # tokenizers raises bare Exceptions
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"{where}: the tokenizer cannot encode this row: {e}") from None

    def _encode_checked(self, messages: list[dict], where: str) -> Encoded:
        full, spans = self.spans(messages, where)
        cuts = sorted({c for span in spans for c in span} - {0, len(full)})
        ids = self._encode(full)
        index = {0: 0, len(full): len(ids)}
        merged = 0
        for c in cuts:
            head = self._encode(full[:c])
            if ids[: len(head)] == head:
                index[c] = len(head)
            else:
                merged += 1
        if merged:  # piece by piece: every boundary then falls between tokens
            ids, pos = [], 0
            for a, b in zip([0, *cuts], [*cuts, len(full)]):
                ids += self._encode(full[a:b])
                index[b] = len(ids)
                pos = b
            assert pos == len(full)
        mask = [False] * len(ids)
        for a, b in spans:
            for j in range(index[a], index[b]):
                mask[j] = True
        return Encoded(ids, mask, merged)


class MindFormersAlpacaEncoder:
    """MindFormers' ``AlpacaInstructDataHandler`` text and labels (see the module docstring) for
    alpaca rows (``instruction``, ``input``, ``output``; no ``history``)."""

    system = ("A chat between a curious user and an artificial intelligence assistant. "
              "The assistant gives helpful, detailed, and polite answers to the user's questions.")
    prompt_with_input = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                         "Write a response that appropriately completes the request.\n\n"
                         "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
    prompt_without_input = ("Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
                            "### Instruction:\n{instruction}\n\n### Response:")

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids  # the handler calls tokenizer(text): the tokenizer's own specials apply

    def encode_row(self, row: dict, where: str = "row") -> Encoded:
        """Raises ValueError for a row without ``instruction`` / ``output`` or with ``history``."""
        if "instruction" not in row or "output" not in row:
            raise ValueError(f"{where}: --data.template mindformers-alpaca needs alpaca rows (instruction, input, output); keys: {sorted(row)}")
        if row.get("history"):
            raise ValueError(f"{where}: MindFormers' alpaca handler has no 'history'; use --data.template chat for multi-turn rows")
        for key in ("instruction", "output", "input"):
            if key in row and row[key] is not None and not isinstance(row[key], str):
                raise ValueError(f"{where}: '{key}' must be a string, got {type(row[key]).__name__}")
        values = {"instruction": row["instruction"], "input": row.get("input") or ""}
        prompt = (self.prompt_with_input if values["input"] else self.prompt_without_input).format_map(values)
        parts = [(f"{self.system} ", False), (f"USER: {prompt} ", False), (f"ASSISTANT: {row['output']}</s>", True)]
        ids, mask = [], []
        for text, trained in parts:
            piece = self._encode(text)
            ids += piece
            mask += [trained] * len(piece)
        return Encoded(ids, mask)
