"""What the repository ships stays redistributable and small: every evaluation record names its dataset and a
licence established for it (records whose licence is not are left out), and a clone's tracked files stay under
the size the README promises for `git clone --depth 1`."""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "medusa_spec" / "data"
TRACKED_LIMIT = 60_000_000  # bytes (issue 58: "tracked files <= 60 MB")


def squeeze(text: str) -> str:
    """Licence names as SPDX ids and as prose write them ("CC-BY-SA-3.0", "CC BY-SA 3.0") compare equal."""
    return "".join(c for c in text.lower() if c.isalnum())


def test_every_evaluation_record_has_an_established_licence_named_in_notice():
    notice = (DATA / "NOTICE").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in (DATA / "other_tasks_question.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows, "other_tasks_question.jsonl is empty"
    for row in rows:
        assert row.get("dataset") and row.get("license"), row["question_id"]
        assert row["license"].lower() not in ("unknown", "none", ""), \
            f"{row['question_id']}: licence {row['license']!r} is not established; leave the record out"
        assert squeeze(row["license"]) in squeeze(notice), \
            f"{row['question_id']}: NOTICE does not state {row['license']!r}"
    assert f"({len(rows)} records" in notice, "NOTICE's record count differs from the file's"


def test_tracked_files_stay_under_the_clone_size_limit():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an installed package): no tracked files")
    sizes = {name: (ROOT / name).stat().st_size for name in listed.decode().split("\0")
             if name and (ROOT / name).is_file()}
    biggest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert sum(sizes.values()) <= TRACKED_LIMIT, (
        f"tracked files weigh {sum(sizes.values()) / 1e6:.1f} MB, over {TRACKED_LIMIT / 1e6:.0f} MB; the largest: "
        + ", ".join(f"{n} ({sizes[n] / 1e6:.1f} MB)" for n in biggest))
