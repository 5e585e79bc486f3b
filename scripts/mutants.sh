#!/usr/bin/env bash
# The mutation suite (docs/testing.md): every guarantee and every capability the README
# claims has a mutant, a small source change that the tests must notice.
#   scripts/mutants.sh --all            every mutant (about an hour on 2 cores)
#   scripts/mutants.sh --changed        those of the files changed since the last landing,
#                                       then a rotating sample (--budget-s bounds it)
#   scripts/mutants.sh --only NAME...   these
#   scripts/mutants.sh --list           list them and check that each still applies
# Each mutant is applied to a scratch copy in build-mutants/, never to the work tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec /usr/bin/python3 tests/mutants/run.py "$@"
