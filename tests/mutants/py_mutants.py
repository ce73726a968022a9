"""Python mutants made by cosmic-ray's operators over the modules that decide
money, ownership and delivery.

cosmic-ray rather than mutmut: cosmic-ray writes each mutant into the file
itself, and the system tests start api, worker and sweeper processes that
import the code from disk; mutmut 3 switches its mutants on inside the test
process (trampolines keyed by an environment variable and its own copy of
the tree), which the processes a test starts would not see as a plain file.
Only cosmic-ray's operators and its mutation of one occurrence are used: the
scratch copies, the choice of tests and the verdicts are the runner's, as for
the SQL mutants.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import cosmic_ray.plugins
from cosmic_ray.ast import ast_nodes, get_ast
from cosmic_ray.ast.ast_query import ASTQuery
from cosmic_ray.mutating import mutate_code

# the modules the issue names: what decides money, ownership and delivery
MODULES: tuple[str, ...] = (
    "worker/ends.py", "worker/claimer.py", "worker/held.py", "worker/pg_store.py",
    "worker/batch/anthropic_batches.py", "worker/batch/anthropic_reading.py", "worker/batch/collector.py",
    "worker/batch/lane.py", "worker/batch/offline_batches.py", "worker/batch/provider.py",
    "worker/batch/provider_structs.py", "worker/batch/reconciler.py", "worker/batch/rows.py",
    "worker/batch/store.py", "worker/batch/submitter.py",
    "worker/delivery/loop.py", "worker/delivery/rows.py", "worker/delivery/send.py",
    "worker/delivery/store.py",
    "api/admission.py", "api/enqueue.py",
    "shared/webhooks.py", "shared/pricing.py", "shared/ratelimit.py",
)
# of api/enqueue.py the POST handler and what decides its answer
ONLY: dict[str, frozenset[str]] = {
    "api/enqueue.py": frozenset({"generate_story", "_enqueue", "_idempotency_key", "_replay", "_accepted",
                                 "decode_bytes", "budget_retry_after"}),
}
# the operators that change a decision; cosmic-ray's full product of
# arithmetic operators (x << y for x + y, ...) mostly makes code that
# crashes at once, which proves nothing about the tests
OPERATORS: tuple[str, ...] = (
    "core/ReplaceComparisonOperator_Eq_NotEq", "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceComparisonOperator_Lt_LtE", "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE", "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Is_IsNot", "core/ReplaceComparisonOperator_IsNot_Is",
    "core/ReplaceBinaryOperator_Add_Sub", "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceBinaryOperator_Mul_Div", "core/ReplaceBinaryOperator_Div_Mul",
    "core/AddNot", "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr", "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue", "core/ZeroIterationForLoop", "core/NumberReplacer",
)


@dataclass(frozen=True)
class PyMutant:
    """One occurrence of one cosmic-ray operator in one module."""

    file: str
    definition: str
    operator: str
    occurrence: int
    line: int
    original: str
    mutated: str

    @property
    def where(self) -> str:
        return f"{self.definition} (line {self.line})"

    @property
    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.original.splitlines(keepends=True),
                                            self.mutated.splitlines(keepends=True),
                                            f"a/{self.file}", f"b/{self.file}", n=1))

    @property
    def key(self) -> str:
        """Stable over edits elsewhere: the file, the function and the changed lines."""
        changed = "".join(line for line in self.diff.splitlines(keepends=True)[2:]
                          if line[:1] in "+-" and not line.startswith("@@"))
        digest = hashlib.sha256("\0".join((self.file, self.definition, self.operator, changed)).encode())
        return digest.hexdigest()[:16]

    def apply(self, text: str) -> str:
        if text != self.original:
            raise ValueError(f"{self.file} changed since its mutants were made")
        return self.mutated


def _only_the_call_convention(source: str, mutated: str) -> bool:
    """True when the mutant only turns a parameter list's bare ``*`` into
    ``/`` (cosmic-ray reads it as a multiplication): callers that pass by
    keyword call it the same, so it changes nothing but a signature."""
    changed = [(a, b) for a, b in zip(source.splitlines(), mutated.splitlines(), strict=False) if a != b]
    return len(changed) == 1 and re.sub(r"([(,]\s*)\*(\s*[,)])", r"\1/\2", changed[0][0]) == changed[0][1]


def mutants_of(root: Path, file: str) -> list[PyMutant]:
    source = (root / file).read_text()
    module = get_ast(source)
    keep = ONLY.get(file)
    made: list[PyMutant] = []
    for name in OPERATORS:
        operator = cosmic_ray.plugins.get_operator(name)()
        positions = [(node, start) for node in ast_nodes(module) for start, _ in operator.mutation_positions(node)]
        for occurrence, (node, start) in enumerate(positions):
            definition = ASTQuery(node).get_definition_name() or "<module>"
            if keep is not None and definition not in keep:
                continue
            mutated = mutate_code(source, operator, occurrence)
            if mutated is None or mutated == source or _only_the_call_convention(source, mutated):
                continue
            made.append(PyMutant(file=file, definition=definition, operator=name.removeprefix("core/"),
                                 occurrence=occurrence, line=start[0], original=source, mutated=mutated))
    return made


def population(root: Path) -> list[PyMutant]:
    """Every Python mutant of MODULES under ``root``."""
    return [mutant for file in MODULES for mutant in mutants_of(root, file)]
