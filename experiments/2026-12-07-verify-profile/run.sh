# Alone on the machine: one_node.py old / new alternately, one process each, twice.
cd "$(dirname "$0")/../.." || exit 1
for round in 1 2; do
  for kind in old new; do
    .venv/bin/python experiments/2026-12-07-verify-profile/one_node.py $kind 2>&1 | grep -E "^(old|new) "
  done
done
