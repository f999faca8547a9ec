"""Tokenize text into a Megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

    python -m mff.recipes.preprocess --tokenizer PATH --output-prefix PREFIX [--input PATH ...]
        [--text-field text] [--workers N] [--append-eod | --no-append-eod] [--dtype auto]

Inputs are .jsonl files (one document per line, text in ``--text-field``), .txt files (one
document per file), .parquet files (one document per row, text in the ``--text-field``
column) and folders (every such file inside, recursively, sorted by path). No ``--input``: the
default corpus, the .py files of the running Python's standard library (as the pretraining
recipe finds them), so the recipe runs offline. Documents are written in input order, one
sequence per document, each followed by the EOD token; empty or white-space-only documents
are dropped, and .txt files that are not UTF-8 are skipped (both counted in the summary).

``--tokenizer`` is a Hugging Face tokenizer.json or a tiktoken rank file (``*.tiktoken``, see
:mod:`mff.data.tiktoken_bpe`). Tokenization runs in ``--workers`` processes on chunks of
documents whose results are written back in order, so the output is byte-identical for any
worker count. A tiktoken file is encoded with the ``tiktoken`` library when it is installed
(same ids, several times faster); ``--backend`` forces one or the other.

The pair is written under temporary names beside ``PREFIX`` and renamed into place at the end
(:class:`mff.data.indexed.IndexedDatasetBuilder`): a failed or interrupted run leaves no
``PREFIX.bin``/``PREFIX.idx`` and no temporary files. An existing prefix is refused unless
``--overwrite`` is given.
"""

from __future__ import annotations

import collections
import importlib.util
import itertools
import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Literal, Sequence

import numpy as np
import tyro
from tqdm import tqdm

from mff.ckpt.checkpoint import pid_alive
from mff.data.corpus import discover_files
from mff.data.indexed import IndexedDatasetBuilder, best_dtype, bin_path, idx_path
from mff.data.tiktoken_bpe import TiktokenEncoder, is_tiktoken_file
from mff.data.tokenizer import find_eod_id, load_tokenizer
from mff.recipes.common import fail

__all__ = ["PreprocessConfig", "PreprocessResult", "InputFile", "find_inputs", "iter_documents", "preprocess", "main"]

SUFFIXES = {".jsonl": "jsonl", ".txt": "text", ".parquet": "parquet"}
"""Input file suffix -> kind."""


@dataclass(frozen=True)
class PreprocessConfig:
    """Tokenize text files into a Megatron indexed dataset."""

    tokenizer: str
    """Tokenizer: a Hugging Face tokenizer.json or a tiktoken rank file (*.tiktoken)."""
    output_prefix: str
    """Output path without suffix: PREFIX.bin and PREFIX.idx are written."""
    input: tuple[str, ...] = ()
    """Input .jsonl, .txt or .parquet files, or folders of them (searched recursively). Empty:
    the .py files of the running Python's standard library, one document per file."""
    text_field: str = "text"
    """The .jsonl field or .parquet column holding each document's text."""
    workers: int = 0
    """Tokenizer processes; 0: one per CPU core. 1 tokenizes in this process (the tokenizers
    library may still use several threads there); each worker process uses one thread."""
    append_eod: bool = True
    """Append the end-of-document token after every document."""
    eod_token: str | None = None
    """End-of-document token. None: the first special token of the tokenizer among
    <|endoftext|>, </s>, <|end_of_text|>, <eos>, <｜end▁of▁sentence｜>."""
    dtype: Literal["auto", "uint8", "uint16", "int32", "int64"] = "auto"
    """Token dtype in PREFIX.bin; auto: uint16 when the vocabulary has fewer than 65500 ids,
    else int32 (Megatron's choice)."""
    backend: Literal["auto", "tokenizers", "tiktoken"] = "auto"
    """Encoder: tiktoken (tiktoken files only, needs the tiktoken package), tokenizers (the HF
    library), or auto (tiktoken for a tiktoken file when the package is installed)."""
    chunk_kb: int = 512
    """Size of one worker task, in KiB of text (documents are never split)."""
    overwrite: bool = False
    """Replace an existing PREFIX.bin/PREFIX.idx (and, with --train-tokenizer, an existing --tokenizer file)."""
    train_tokenizer: bool = False
    """First train a byte-level BPE of --vocab-size tokens on the input documents (the `tokenizers` library, the EOD token
    --eod-token or <|endoftext|> at id 0) and write it to --tokenizer as tokenizer.json, then tokenize with it."""
    vocab_size: int = 8192
    """Vocabulary size of the tokenizer --train-tokenizer trains (>= 257: 256 bytes and the EOD token)."""


@dataclass(frozen=True)
class PreprocessResult:
    """What `preprocess` wrote.

    Attributes:
        prefix: the output prefix; ``bin``, ``idx``: the two files.
        documents: documents written (sequences in the dataset).
        tokens: tokens written, EODs included.
        bytes: UTF-8 bytes of the documents' text.
        seconds: wall time from the first read to the renamed files.
        tokenize_seconds: the part of it spent tokenizing and writing, after the tokenizer
            workers started (what ``mb_per_s`` divides by).
        files: input files read.
        empty_dropped: empty or white-space-only documents dropped.
        non_utf8_skipped: .txt files skipped because they are not UTF-8.
        dtype: token dtype name; ``backend``: ``"tokenizers"`` or ``"tiktoken"``; ``workers``.
    """

    prefix: str
    bin: str
    idx: str
    documents: int
    tokens: int
    bytes: int
    seconds: float
    files: int
    empty_dropped: int
    non_utf8_skipped: int
    dtype: str
    backend: str
    workers: int
    tokenize_seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        """Megabytes (1e6) of document text per second of tokenizing (worker start-up excluded)."""
        return self.bytes / 1e6 / max(self.tokenize_seconds or self.seconds, 1e-9)


@dataclass(frozen=True)
class InputFile:
    """One input: absolute ``path``, ``kind`` (``"jsonl"``, ``"text"`` or ``"parquet"``) and
    ``size`` in bytes."""

    path: str
    kind: str
    size: int


def find_inputs(paths: Sequence[str]) -> list[InputFile]:
    """The input files, in argument order; a folder contributes its .jsonl/.txt/.parquet files
    (recursively, other files ignored) sorted by relative path. Empty `paths`: the default
    corpus (`mff.data.corpus.discover_files`).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a named file has another suffix, or a folder holds no input file.
    """
    if not paths:
        files, _ = discover_files([])
        return [InputFile(f.path, "text", f.size) for f in files]
    out: list[InputFile] = []
    for raw in paths:
        path = os.path.abspath(os.path.expanduser(raw))
        if os.path.isfile(path):
            kind = SUFFIXES.get(os.path.splitext(path)[1].lower())
            if kind is None:
                raise ValueError(f"preprocess: unsupported input file {raw!r}: expected a .jsonl, .txt or .parquet file or a folder")
            out.append(InputFile(path, kind, os.path.getsize(path)))
        elif os.path.isdir(path):
            found = []
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames.sort()
                for name in filenames:
                    kind = SUFFIXES.get(os.path.splitext(name)[1].lower())
                    if kind is not None:
                        full = os.path.join(dirpath, name)
                        found.append((os.path.relpath(full, path).replace(os.sep, "/"), InputFile(full, kind, os.path.getsize(full))))
            if not found:
                raise ValueError(f"preprocess: input folder {raw!r} holds no .jsonl, .txt or .parquet files")
            out.extend(f for _, f in sorted(found, key=lambda t: t[0]))
        else:
            raise FileNotFoundError(f"preprocess: input path not found: {raw!r}")
    return out


def iter_documents(f: InputFile, text_field: str = "text") -> Iterator[tuple[str | None, int]]:
    """Yield ``(text, file bytes consumed)`` for each document of `f`, in file order.

    ``text`` is None for a record that is not a document (a blank .jsonl line) or a .txt file
    that is not UTF-8 (its byte count is then the whole file, and the caller counts it as
    skipped); the byte counts of one file add up to its size (parquet: row share of the file).

    Raises:
        ValueError: a .jsonl line that is not UTF-8, not valid JSON, not an object with the
            field, or whose field is not a string; a .parquet file without the column, with a
            non-string column or a null value. Messages name the file and the 1-based line or
            row.
        ModuleNotFoundError: a .parquet input without pyarrow installed.
    """
    if f.kind == "text":
        with open(f.path, "rb") as fh:
            raw = fh.read()
        try:
            yield raw.decode("utf-8"), len(raw)
        except UnicodeDecodeError:
            yield None, len(raw)
    elif f.kind == "jsonl":
        with open(f.path, "rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    yield None, len(line)
                    continue
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise ValueError(f"preprocess: {f.path}:{lineno}: not valid UTF-8 (byte {e.start})") from None
                except json.JSONDecodeError as e:
                    raise ValueError(f"preprocess: {f.path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or text_field not in record:
                    what = f"keys {sorted(record)[:8]}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
                    raise ValueError(f"preprocess: {f.path}:{lineno}: no {text_field!r} field in the record ({what}); set --text-field")
                value = record[text_field]
                if not isinstance(value, str):
                    raise ValueError(f"preprocess: {f.path}:{lineno}: field {text_field!r} is {type(value).__name__}, expected a string")
                yield value, len(line)
    elif f.kind == "parquet":
        yield from _iter_parquet(f, text_field)
    else:
        raise ValueError(f"preprocess: unknown input kind {f.kind!r} for {f.path}")


def _iter_parquet(f: InputFile, text_field: str) -> Iterator[tuple[str | None, int]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"preprocess: reading {f.path} needs pyarrow: pip install 'mff[parquet]'") from None
    try:
        pf = pq.ParquetFile(f.path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"preprocess: {f.path}: not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise ValueError(f"preprocess: {f.path}: no column {text_field!r} (columns: {schema.names}); set --text-field")
    typ = schema.field(text_field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
        raise ValueError(f"preprocess: {f.path}: column {text_field!r} has type {typ}, expected a string column")
    total, done, row = max(pf.metadata.num_rows, 1), 0, 0
    for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                raise ValueError(f"preprocess: {f.path}: row {row}: column {text_field!r} is null, expected a string")
            consumed = f.size * row // total - done
            done += consumed
            yield value, consumed
    if done < f.size:
        yield None, f.size - done


# --- worker side: one encoder per process, set by _init_worker --------------------------------
_ENCODER = None
_EOD: int | None = None
_DTYPE = np.dtype(np.int32)


def _init_worker(encoder, eod: int | None, dtype: str, in_worker: bool) -> None:
    """Set this process's encoder; in a worker process: one tokenizers thread, Ctrl-C left to
    the parent, default SIGTERM (so Pool.terminate stops it quietly)."""
    global _ENCODER, _EOD, _DTYPE
    if in_worker:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _ENCODER, _EOD, _DTYPE = encoder, eod, np.dtype(dtype)


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode documents (no special tokens added) with the process's encoder.

    Returns:
        ``(tokens, lengths)``: the documents' ids back to back, each followed by the EOD when
        one is set, as one array of the output dtype; and int64 [len(texts)] their lengths
        (EOD included).

    Raises:
        ValueError: an id that does not fit the output dtype.
    """
    if isinstance(_ENCODER, TiktokenEncoder):
        ids = _ENCODER.encode_batch(texts)
    else:
        ids = [e.ids for e in _ENCODER.encode_batch(texts, add_special_tokens=False)]
    if _EOD is not None:
        for x in ids:
            x.append(_EOD)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and _DTYPE.kind in "iu":
        info = np.iinfo(_DTYPE)
        if flat.min() < info.min or flat.max() > info.max:
            raise ValueError(f"preprocess: token id {int(flat.max())} does not fit --dtype {_DTYPE}")
    return flat.astype(_DTYPE), lengths


def _chunks(files: Sequence[InputFile], text_field: str, chunk_chars: int, counts: dict) -> Iterator[tuple[list[str], int, int]]:
    """Group the documents of `files` into ``(texts, UTF-8 bytes of the texts, file bytes)``
    tasks of about `chunk_chars` characters; counts ``empty`` and ``non_utf8`` in `counts`."""
    texts: list[str] = []
    size = text_bytes = file_bytes = 0
    for f in files:
        for text, consumed in iter_documents(f, text_field):
            file_bytes += consumed
            if text is None:
                if f.kind == "text":
                    counts["non_utf8"] += 1
                continue
            if not text.strip():
                counts["empty"] += 1
                continue
            texts.append(text)
            size += len(text)
            text_bytes += len(text.encode("utf-8"))
            if size >= chunk_chars:
                yield texts, text_bytes, file_bytes
                texts, size, text_bytes, file_bytes = [], 0, 0, 0
    if texts or file_bytes:
        yield texts, text_bytes, file_bytes


def _load(cfg: PreprocessConfig):
    """The encoder for ``--backend``: a `TiktokenEncoder` (auto: for a tiktoken file when the
    tiktoken package is installed) or the `tokenizers.Tokenizer` from `load_tokenizer`."""
    path = os.path.abspath(os.path.expanduser(cfg.tokenizer))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"preprocess: tokenizer file not found: {cfg.tokenizer!r}")
    backend = cfg.backend
    if backend == "auto":
        backend = "tiktoken" if is_tiktoken_file(path) and importlib.util.find_spec("tiktoken") else "tokenizers"
    if backend == "tiktoken":
        if not is_tiktoken_file(path):
            raise ValueError(f"preprocess: --backend tiktoken needs a tiktoken rank file, got {cfg.tokenizer!r}")
        return TiktokenEncoder(path)
    return load_tokenizer(path)


def _remove_stale_tmp(prefix: str) -> None:
    """Remove ``PREFIX.bin.tmp-<pid>`` / ``PREFIX.idx.tmp-<pid>`` left by killed runs (pid gone)."""
    folder, base = os.path.split(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        for suffix in (".bin.tmp-", ".idx.tmp-"):
            head, _, pid = name.partition(suffix)
            if head == base and pid.isdigit() and not pid_alive(int(pid)):
                try:
                    os.remove(os.path.join(folder, name))
                except OSError:
                    pass


def preprocess(cfg: PreprocessConfig, progress: bool = True) -> PreprocessResult:
    """Tokenize the inputs of `cfg` into ``PREFIX.bin``/``PREFIX.idx`` (see the module docstring).

    Args:
        cfg: the run's config.
        progress: show a progress bar (bytes of input, MB/s) on stderr.

    Returns:
        `PreprocessResult`.

    Raises:
        FileNotFoundError: an input or the tokenizer is missing.
        FileExistsError: the prefix exists and ``overwrite`` is off.
        ValueError: bad input (the message names the file and line or row), no documents, an
            unknown EOD token, a bad tokenizer file, ``workers`` < 0 or ``chunk_kb`` < 1, or a
            vocabulary that does not fit ``dtype``.
        ModuleNotFoundError: parquet input without pyarrow; ``--backend tiktoken`` without
            tiktoken.
    """
    if cfg.workers < 0:
        raise ValueError(f"preprocess: --workers must be >= 0 (0 = one per CPU core), got {cfg.workers}")
    if cfg.chunk_kb < 1:
        raise ValueError(f"preprocess: --chunk-kb must be >= 1, got {cfg.chunk_kb}")
    t0 = time.perf_counter()
    files = find_inputs(cfg.input)
    if not files:
        raise ValueError("preprocess: no input files found")
    prefix = os.path.abspath(os.path.expanduser(cfg.output_prefix))
    if os.path.isdir(prefix) or not os.path.basename(prefix):
        raise ValueError(f"preprocess: --output-prefix {cfg.output_prefix!r} is a folder; give a path without suffix, e.g. {prefix}/data")
    existing = [p for p in (bin_path(prefix), idx_path(prefix)) if os.path.exists(p)]
    if existing and not cfg.overwrite:
        raise FileExistsError(f"preprocess: {existing[0]} exists; pass --overwrite to replace it or choose another --output-prefix")
    if cfg.train_tokenizer:
        train_tokenizer_file(cfg, files)
    tok = _load(cfg)
    eod = find_eod_id(tok, cfg.eod_token, flag="--eod-token") if cfg.append_eod else None
    if isinstance(tok, TiktokenEncoder):
        n_ids = tok.get_vocab_size()
    else:
        n_ids = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    dtype = best_dtype(n_ids) if cfg.dtype == "auto" else np.dtype(cfg.dtype)
    if dtype.kind in "iu" and n_ids - 1 > np.iinfo(dtype).max:
        raise ValueError(f"preprocess: --dtype {cfg.dtype}: the tokenizer's ids go up to {n_ids - 1}, more than {dtype} holds")
    backend = "tiktoken" if isinstance(tok, TiktokenEncoder) else "tokenizers"
    workers = cfg.workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    _remove_stale_tmp(prefix)

    counts = {"empty": 0, "non_utf8": 0}
    documents = tokens = text_bytes = 0
    pool = None
    if workers > 1:
        # never "fork": the caller may have threads (torch's, tqdm's monitor, a test runner's) whose
        # locks a forked child inherits held, and a worker then hangs; the forkserver (a fresh
        # single-threaded process, Python 3.14's default) or spawn start clean
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tok, eod, dtype.name, True))
        pool.map(abs, range(workers), chunksize=1)  # every worker started and holds the tokenizer: start-up is not tokenizing
    else:
        _init_worker(tok, eod, dtype.name, False)
    t_tokenize = time.perf_counter()
    bar = tqdm(total=sum(f.size for f in files), unit="B", unit_scale=True, desc="preprocess", file=sys.stderr,
               disable=not (progress and sys.stderr.isatty()), dynamic_ncols=True)
    try:
        with IndexedDatasetBuilder(prefix, dtype) as builder:

            def write(result: tuple[np.ndarray, np.ndarray], nbytes: int, fbytes: int) -> None:
                nonlocal documents, tokens, text_bytes
                flat, lengths = result
                start = 0
                for n in lengths.tolist():
                    builder.add_document(flat[start : start + n])
                    start += n
                documents += len(lengths)
                tokens += int(flat.size)
                text_bytes += nbytes
                bar.update(fbytes)

            pending: collections.deque = collections.deque()
            for texts, nbytes, fbytes in _chunks(files, cfg.text_field, cfg.chunk_kb * 1024, counts):
                if pool is None:
                    write(_encode_chunk(texts), nbytes, fbytes)
                    continue
                pending.append((pool.apply_async(_encode_chunk, (texts,)), nbytes, fbytes))
                while len(pending) >= 2 * workers:
                    res, nb, fb = pending.popleft()
                    write(res.get(), nb, fb)
            while pending:
                res, nb, fb = pending.popleft()
                write(res.get(), nb, fb)
            if documents == 0:
                raise ValueError(f"preprocess: no non-empty documents in {len(files)} input files "
                                 f"({counts['empty']} empty, {counts['non_utf8']} .txt files not UTF-8)")
    finally:
        bar.close()
        _init_worker(None, None, "int32", False)
        if pool is not None:
            pool.terminate()
            pool.join()
    t_end = time.perf_counter()
    seconds, tokenize_seconds = t_end - t0, t_end - t_tokenize
    return PreprocessResult(
        prefix=prefix, bin=bin_path(prefix), idx=idx_path(prefix), documents=documents, tokens=tokens, bytes=text_bytes,
        seconds=seconds, files=len(files), empty_dropped=counts["empty"], non_utf8_skipped=counts["non_utf8"],
        dtype=dtype.name, backend=backend, workers=workers, tokenize_seconds=tokenize_seconds,
    )


def train_tokenizer_file(cfg: PreprocessConfig, files: Sequence[InputFile]) -> str:
    """Train a byte-level BPE (:func:`mff.data.tokenizer.train_bpe`) of ``cfg.vocab_size`` tokens
    on the documents of ``files`` and write it to ``cfg.tokenizer`` (temp name, then rename).
    Returns the path. Raises FileExistsError when the file exists without ``--overwrite``,
    ValueError for a vocab size below 257, a tiktoken path or no documents."""
    from mff.data.tokenizer import DEFAULT_EOD_TOKEN, MIN_BPE_VOCAB, train_bpe

    path = os.path.abspath(os.path.expanduser(cfg.tokenizer))
    if cfg.vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"preprocess: --vocab-size {cfg.vocab_size} must be at least {MIN_BPE_VOCAB} (256 bytes + EOD)")
    if path.endswith(".tiktoken"):
        raise ValueError(f"preprocess: --train-tokenizer writes a tokenizer.json, not a tiktoken file: {cfg.tokenizer}")
    if os.path.exists(path) and not cfg.overwrite:
        raise FileExistsError(f"preprocess: {cfg.tokenizer} exists; pass --overwrite to replace it, or drop --train-tokenizer to use it")
    texts = [t for chunk, _, _ in _chunks(files, cfg.text_field, cfg.chunk_kb * 1024, {"empty": 0, "non_utf8": 0}) for t in chunk]
    if not texts:
        raise ValueError("preprocess: --train-tokenizer found no non-empty documents in the input")
    t0 = time.perf_counter()
    tok = train_bpe(texts, cfg.vocab_size, cfg.eod_token or DEFAULT_EOD_TOKEN)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    except Exception as e:  # tokenizers raises a bare Exception for an unwritable path
        raise OSError(f"preprocess: cannot write the trained tokenizer to {cfg.tokenizer}: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"preprocess: trained a byte-level BPE of {tok.get_vocab_size():,} tokens on {len(texts):,} documents in "
          f"{time.perf_counter() - t0:.1f} s: {cfg.tokenizer}", flush=True)
    return path


def summary(r: PreprocessResult) -> str:
    """The lines `main` prints after a run."""
    def size(path: str) -> str:
        n = os.path.getsize(path)
        return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:,} B"

    return "\n".join([
        f"preprocess: {r.documents:,} documents from {r.files:,} files ({r.empty_dropped:,} empty dropped, "
        f"{r.non_utf8_skipped:,} non-UTF-8 files skipped)",
        f"preprocess: {r.tokens:,} tokens ({r.dtype}), {r.bytes / 1e6:.1f} MB of text tokenized in {r.tokenize_seconds:.1f} s: "
        f"{r.mb_per_s:.2f} MB/s, {r.tokens / max(r.tokenize_seconds, 1e-9):,.0f} tokens/s ({r.backend}, "
        f"{r.workers} worker{'s' if r.workers != 1 else ''}; {r.seconds:.1f} s in all, start-up and reading the tokenizer included)",
        f"preprocess: wrote {r.bin} ({size(r.bin)}) and {r.idx} ({size(r.idx)})",
    ])


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGTERM, _terminate)  # remove the temp files on kill too
    try:
        cfg = tyro.cli(PreprocessConfig, args=argv, prog="python -m mff.recipes.preprocess", description=__doc__)
        print(summary(preprocess(cfg)), flush=True)
        return 0
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written to --output-prefix", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, FileExistsError, ModuleNotFoundError) as e:
        return fail(e, 2)
    except OSError as e:
        return fail(e, 1)


if __name__ == "__main__":
    sys.exit(main())
