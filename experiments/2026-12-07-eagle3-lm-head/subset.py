"""The compare text's prompts (../2026-12-06-eagle3-stage4/NOTES.md's SUBSET): the first two prompts of each category of
the shipped MT-bench and other-task-type files, 26 in all, as JSONL. Usage: python subset.py OUT"""
import json
import sys
from collections import Counter

from medusa_spec.bench import MT_BENCH

records, seen = [], Counter()
for path in (MT_BENCH, MT_BENCH.with_name("other_tasks_question.jsonl")):
    seen.clear()
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if seen[record.get("category")] < 2:
            seen[record.get("category")] += 1
            records.append(record)
with open(sys.argv[1], "w") as out:
    out.writelines(json.dumps(record) + "\n" for record in records)
print(len(records), "prompts")
