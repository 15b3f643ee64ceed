"""Where distilled conversations live: one JSONL file, or a folder of gzipped chunks that any
machine can continue (and a repository can hold: the chunks are written once, never rewritten).

A folder holds `part-00000.jsonl.gz`, `part-00001.jsonl.gz`, ... (complete, immutable) and
`open.jsonl`, the chunk being written, fsynced after every append. When `open.jsonl` holds
`chunk_size` records it is compressed into the next part (written aside, fsynced, renamed) and
removed; a kill at any point leaves either the open file or the part, and the next start drops a
duplicate open file and a line cut short.
"""

from __future__ import annotations

import gzip
import json
import os
import weakref
import zlib
from pathlib import Path

from ..folders import check_output_folder

try:
    import fcntl
except ImportError:  # Windows: no flock; keeping to one writer per output is then the user's part
    fcntl = None

OPEN = "open.jsonl"
MODEL = "model.json"  # which model's answers a folder holds (record_model)


def _parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("part-*.jsonl.gz"))


RECORD_START = b'{"id": '  # how every line append writes begins


def complete_lines(file: Path, cut: bytes = b"") -> bytes:
    """The file's bytes through its last newline. `cut` (its writer only, once the complete lines are known to be
    its own): how the writer's lines begin; a final line left short by a kill, which begins so, is cut off the file
    on disk, so the next append starts a line, and any other is refused, untouched. A reader must not cut, since the
    writer may be halfway through writing that line."""
    data = file.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if cut and len(complete) != len(data):
        tail = data[len(complete):]
        if not (tail.startswith(cut) or cut.startswith(tail)):
            raise ValueError(f"{file}: its last line is not one distill writes; write to a new --output")
        with open(file, "r+b") as f:
            f.truncate(len(complete))
    return complete


def read_gzip(path: Path, remedy: str = "delete it to distil its conversations again") -> bytes:
    """A gzip file distill wrote whole (a sealed chunk, the sealed prompts), decompressed; a damaged one is refused,
    naming what else to do with it (`remedy`) than restoring it."""
    try:
        return gzip.decompress(path.read_bytes())
    except (EOFError, OSError, zlib.error):  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path} is damaged (not a complete gzip file): restore it (git checkout -- {path}), or "
                         f"{remedy}") from None


def _records(data: bytes, source: Path) -> list[dict]:
    records = []
    # Split at "\n" only: str.splitlines also splits at characters JSON keeps raw inside strings (U+2028, U+0085).
    for number, line in enumerate(data.decode("utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{source}:{number}: not a distill record; write to a new --output") from None
        if not isinstance(record, dict) or "id" not in record:
            raise ValueError(f"{source}:{number}: not a distill record (no id); write to a new --output")
        records.append(record)
    return records


def is_folder(path: str | Path) -> bool:
    """A path ending in .jsonl is one file; anything else is a chunked folder."""
    return not str(path).endswith(".jsonl")


def read_records(path: str | Path) -> list[dict]:
    """Every record of a file or folder, in the order written (a last line not yet complete, cut short by a kill or
    still being written, is passed over and left as it is)."""
    path = Path(path)
    if not is_folder(path):
        return _records(complete_lines(path), path) if path.is_file() else []
    if not path.is_dir():
        return []
    while True:  # a writer may seal open.jsonl into a new part while this reads: then read again
        parts = _parts(path)
        records = [r for part in parts for r in _records(read_gzip(part), part)]
        open_file = path / OPEN
        try:
            opened = _records(complete_lines(open_file), open_file)
        except FileNotFoundError:
            opened = []
        if _parts(path) == parts:
            break
    seen = {r["id"] for r in records}
    # A kill between writing a part and removing open.jsonl leaves its records twice.
    return records + [r for r in opened if r["id"] not in seen]


def _hold_writer_lock(path: Path, owner: object) -> None:
    """An exclusive flock on the store's folder (or file) for `owner`'s life: a second writer would interleave its
    parts with this one's, losing and repeating records. No lock file is left behind; the kernel drops the lock
    when its holder dies."""
    if fcntl is None:
        return
    fd = os.open(path, os.O_RDONLY | (0 if path.is_dir() else os.O_CREAT), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"{path} is being written by another distill run (it holds its lock): wait for that run to "
                         f"end, or write to another --output") from None
    weakref.finalize(owner, os.close, fd)


# How far a `weights` sum of the record may move between loads of one model in another dtype (distill.model_identity):
# bfloat16 and float16 loads of SmolLM2-135M moved them by far less than this; a fine-tune moves them more.
WEIGHTS_RTOL = 1e-3


def recorded_model(path: str | Path) -> dict | None:
    """The model recorded in the folder `path` (None: a single file, or a folder from before the record)."""
    file = Path(path) / MODEL
    if not (is_folder(path) and file.is_file()):
        return None
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{file} is damaged (not JSON); delete it if the folder holds one model's answers, and the "
                         f"next distill records the model again") from None


def recorded_model_differences(path: str | Path, identity: dict) -> list[str]:
    """How `identity` differs from the model recorded in the folder `path`, over the keys both name ([] where there
    is no record). A record of a served model and one of a local model share no key: that is a difference too."""
    recorded = recorded_model(path)
    if recorded is None:
        return []
    if not recorded.keys() & identity.keys():
        return [f"recorded as {recorded}, here {identity}"]

    def same(key):
        if key == "weights" and len(recorded[key]) == len(identity[key]):
            return all(abs(a - b) <= WEIGHTS_RTOL * max(abs(a), abs(b)) for a, b in zip(recorded[key], identity[key]))
        return recorded[key] == identity[key]

    return [f"{key} {recorded[key]!r} there, {identity[key]!r} here"
            for key in sorted(recorded.keys() & identity.keys()) if not same(key)]


def record_model(path: str | Path, identity: dict) -> None:
    """A folder's answers come from one model: the first run records it there (MODEL), and a later one writing into
    the folder must be that model. A single JSONL file has no room for the record."""
    path = Path(path)
    if not is_folder(path):
        return
    differences = recorded_model_differences(path, identity)
    if differences:
        raise ValueError(f"{path} holds answers of another model, or of one this run cannot compare with its own "
                         f"(a served one and a local one) ({'; '.join(differences)}, {path / MODEL}): distill this "
                         f"model into another --output (train reads several --data folders), or run the model that "
                         f"wrote them")
    if not (path / MODEL).is_file():
        check_output_folder(path)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / f".{MODEL}.tmp"  # a kill leaves the record whole or absent
        tmp.write_text(json.dumps(identity, indent=1) + "\n")
        os.replace(tmp, path / MODEL)


class ConversationStore:
    """Append-only writer, the only one of its output while it lives (a second is refused); `done` holds the ids
    already written (the resume key)."""

    def __init__(self, path: str | Path, chunk_size: int = 2000):
        self.path, self.chunk_size = Path(path), chunk_size
        self.folder = is_folder(self.path)
        check_output_folder(self.path, file_ok=not self.folder)  # not mkdir's FileExistsError
        if self.folder:
            self.path.mkdir(parents=True, exist_ok=True)
            _hold_writer_lock(self.path, self)
            self._seal_if_duplicate()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _hold_writer_lock(self.path, self)
        self._file = self.path / OPEN if self.folder else self.path
        self._open_count = 0
        if self._file.is_file():
            # Read first: a file distill did not write (a prompts file given as --output) is refused untouched. Then,
            # as its writer, a line a kill cut short goes, so the next append starts a line.
            self._open_count = len(_records(complete_lines(self._file), self._file))
            complete_lines(self._file, cut=RECORD_START)
        self.done = {r["id"] for r in read_records(self.path)}

    def _seal_if_duplicate(self) -> None:
        """After a kill between sealing a part and removing open.jsonl, the open file is a copy."""
        open_file, parts = self.path / OPEN, _parts(self.path)
        if open_file.is_file() and parts:
            last = {r["id"] for r in _records(read_gzip(parts[-1]), parts[-1])}
            opened = {r["id"] for r in _records(complete_lines(open_file), open_file)}
            if opened and opened <= last:
                open_file.unlink()

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        with open(self._file, "a", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps({"id": record["id"], **record}, ensure_ascii=False) + "\n")  # RECORD_START
            out.flush()
            os.fsync(out.fileno())  # a written answer survives even a machine crash
        self.done.update(r["id"] for r in records)
        self._open_count += len(records)
        if self.folder and self._open_count >= self.chunk_size:
            self.seal()

    def seal(self) -> None:
        """Compress open.jsonl into the next part (no-op for a single file or an empty chunk)."""
        open_file = self.path / OPEN
        if not self.folder or not open_file.is_file() or self._open_count == 0:
            return
        parts = _parts(self.path)
        number = int(parts[-1].name.split("-")[1].split(".")[0]) + 1 if parts else 0
        part = self.path / f"part-{number:05d}.jsonl.gz"
        tmp = part.with_name(f".{part.name}.tmp")
        # mtime=0: the same records always give the same bytes (stable in a repository).
        tmp.write_bytes(gzip.compress(complete_lines(open_file), compresslevel=9, mtime=0))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, part)
        directory = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        open_file.unlink()
        self._open_count = 0
