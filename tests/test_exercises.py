"""The course's exercises: every shipped solution passes, every untouched stub fails, wrong solutions are rejected.

``check --solutions`` and ``check`` on the pristine stubs run once each, in this process, and each exercise's line is
its own test, so a stub that passes by accident (or a solution that stopped passing) is named. The planted
solutions are the shipped ones with one classic mistake each (a base-2 LSE, a merge without the max shift, an
off-by-one indptr...): the grader must reject every one, at the case that shows the mistake. Then the command line
itself: its exit codes, ``start``'s copy, the default folder, and the notebooks' lists of exercises.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bsrattn.exercises import DEFAULT_DIR, EXERCISES, SOLUTIONS, STUBS, find, grade
from bsrattn.exercises.cli import main
from bsrattn.exercises.course import missing

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
LINE = re.compile(r"^ *(\d+)  (\S+) +(pass|fail|skip)$", re.MULTILINE)


def run(*argv: str) -> tuple[int, str]:
    """``python -m bsrattn.exercises *argv`` in this process: ``(exit code, output)``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(list(argv))
        except SystemExit as err:  # argparse's usage errors
            code = err.code
    return code, out.getvalue()


def statuses(output: str) -> dict:
    """``{number: (name, status)}`` of a ``check``'s lines."""
    return {int(n): (name, status) for n, name, status in LINE.findall(output)}


@pytest.fixture(scope="module")
def solutions_checked():
    return run("check", "--solutions")


@pytest.fixture(scope="module")
def stubs_checked(tmp_path_factory):
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("fresh"))   # no ./bsrattn-exercises there: check grades the pristine stubs
    try:
        return run("check")
    finally:
        os.chdir(here)


def test_list_names_every_exercise_with_its_statement():
    code, out = run("list")
    assert code == 0
    assert "python -m bsrattn.exercises start" in out and "check --dir DIR" in out  # the header says how
    rows = re.findall(r"^ *(\d+)  (\S+) +(.+)$", out, re.MULTILINE)
    assert len(rows) >= 20 and len(rows) == len(EXERCISES)
    assert [int(n) for n, _, _ in rows] == list(range(1, len(EXERCISES) + 1))
    for (_, name, summary), exercise in zip(rows, EXERCISES):
        assert (name, summary) == (exercise.name, exercise.summary)


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: f"{e.number:02d}-{e.name}")
def test_every_exercise_is_a_statement_a_stub_a_solution_and_a_hint(exercise):
    stub, solution = (STUBS / exercise.filename).read_text(), (SOLUTIONS / exercise.filename).read_text()
    assert len(exercise.statement.splitlines()) > 5, "a statement, not a line"
    assert f"python -m bsrattn.exercises check {exercise.number}" in exercise.statement
    assert stub.count(f'NotImplementedError("exercise {exercise.number}: ') >= 1
    assert "NotImplementedError" not in solution
    assert len(exercise.hint) > 60
    assert (ROOT / "notebooks" / f"{exercise.notebook}.py").is_file()


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: f"{e.number:02d}-{e.name}")
def test_check_solutions_passes_each_exercise(exercise, solutions_checked):
    code, out = solutions_checked
    if missing(exercise):
        assert statuses(out)[exercise.number] == (exercise.name, "skip")
        pytest.skip(missing(exercise))
    assert statuses(out)[exercise.number] == (exercise.name, "pass"), out


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: f"{e.number:02d}-{e.name}")
def test_check_fails_each_untouched_stub_with_its_hint(exercise, stubs_checked):
    code, out = stubs_checked
    if missing(exercise):
        pytest.skip(missing(exercise))
    assert "grading the pristine stubs" in out.splitlines()[0]
    assert statuses(out)[exercise.number] == (exercise.name, "fail")
    block = out.split(f"\n{exercise.number:3d}  {exercise.name}", 1)[1].split("\n", 1)[1]
    assert "      case  " in block and "      wrong " in block
    assert " ".join(block.split("      hint  ", 1)[1].split()).startswith(" ".join(exercise.hint.split())[:80])


def test_check_exits_with_1_when_an_exercise_fails_and_0_otherwise(solutions_checked, stubs_checked):
    assert solutions_checked[0] == 0 and solutions_checked[1].splitlines()[-1].endswith(" 0 fail")
    assert stubs_checked[0] == 1 and stubs_checked[1].splitlines()[-1].startswith("0 of ")


# ---- planted wrong solutions: each the shipped solution with one classic mistake --------------------------------

PLANTED = [
    (1, "base-2 LSE", [("return float(m + np.log(np.exp(s - m).sum()))",
                        "return float((m + np.log(np.exp(s - m).sum())) / np.log(2.0))")], "s = [1.0, 2.0, 3.0]"),
    (1, "LSE without the max shift", [("return float(m + np.log(np.exp(s - m).sum()))",
                                       "return float(np.log(np.exp(s).sum()))")], "overflows"),
    (2, "merge without the max shift", [("np.exp(lse_a - m), np.exp(lse_b - m)", "np.exp(lse_a), np.exp(lse_b)"),
                                        ("m + np.log(w_a + w_b)", "np.log(w_a + w_b)")], "overflows"),
    (2, "merge that weighs an empty state's o", [("    if lse_a > -np.inf:\n        o = o + w_a * o_a\n"
                                                  "    if lse_b > -np.inf:\n        o = o + w_b * o_b\n",
                                                  "    o = o + w_a * o_a + w_b * o_b\n")], "NaN"),
    (3, "kv_indptr without its leading 0", [("kv_indptr = np.concatenate([[0], np.cumsum(n_pages)])",
                                             "kv_indptr = np.cumsum(n_pages)")], "kv_indptr has shape"),
    (3, "off-by-one page count", [("n_pages = (kv_lens + page_size - 1) // page_size",
                                   "n_pages = kv_lens // page_size + 1")], "kv_indptr"),
    (3, "a full last page as 0 slots", [("np.where(kv_lens > 0, kv_lens - (n_pages - 1) * page_size, 0)",
                                         "kv_lens % page_size")], "kv_last_len"),
    (4, "ragged indptr without its leading 0", [("return (np.concatenate([[0], np.cumsum(qo_lens)]),",
                                                 "return (np.cumsum(qo_lens),")], "qo_indptr has shape"),
    (5, "block ids read as slots (no * Bc)", [("// block_size] * block_size", "// block_size]")], "pool slot"),
    (6, "a top-left causal mask", [("kv_len - qo_len + np.arange(qo_len)", "np.arange(qo_len)")], "append"),
    (7, "an exclusive window", [("q_pos - k_pos <= window_left", "q_pos - k_pos < window_left")], "window"),
    (9, "a bound from the max key alone", [("np.maximum(q * low, q * high)", "q * high")], "page_bounds"),
    (9, "stale slots past kv_len read", [("< kv_len)", "< 10 ** 9)")], "stale values"),
    (10, "an online softmax that never rescales", [("alpha * acc + p @ v", "acc + p @ v")], "maxima grow"),
    (13, "chunks folded from the right", [(
        "    o, lse = state_of(0, min(chunk, kv_len))\n    for start in range(chunk, kv_len, chunk):\n"
        "        o, lse = ba.merge_state(o, lse, *state_of(start, min(start + chunk, kv_len)))\n",
        "    states = [state_of(s, min(s + chunk, kv_len)) for s in range(0, max(kv_len, 1), chunk)]\n"
        "    o, lse = states[-1]\n    for o_c, lse_c in reversed(states[:-1]):\n"
        "        o, lse = ba.merge_state(o_c, lse_c, o, lse)\n")], "bit for bit"),
    (14, "a merge list folded in reverse", [("plan.merge_indptr[m]:plan.merge_indptr[m + 1]]",
                                            "plan.merge_indptr[m]:plan.merge_indptr[m + 1]][::-1]")], "bit for bit"),
    (15, "round robin instead of the min-heap", [("    longest_first = sorted(",
                                                  "    return [w % num_ctas for w in range(len(costs))]\n"
                                                  "    longest_first = sorted(")], "assign"),
    (18, "cuts relative to the piece's start", [("first_cut = (kv_start // split_size + 1) * split_size",
                                                 "first_cut = kv_start + split_size")], "a piece of a row"),
    (19, "a CUDA tile that never rescales", [("acc[i, d] = alpha * acc[i, d] + weighted",
                                              "acc[i, d] = acc[i, d] + weighted")], "maxima grow"),
    (22, "ALiBi before the soft cap", [(
        "    if soft_cap > 0:\n        s = soft_cap * np.tanh(s / soft_cap)\n"
        "    if alibi_slope is not None:\n"
        "        s = s + alibi_slope * (np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None])\n",
        "    if alibi_slope is not None:\n"
        "        s = s + alibi_slope * (np.asarray(k_pos)[None, :] - np.asarray(q_pos)[:, None])\n"
        "    if soft_cap > 0:\n        s = soft_cap * np.tanh(s / soft_cap)\n")], "the soft cap, then ALiBi"),
    (23, "GQA heads laid out by np.tile", [("np.repeat(k, num_qo_heads // k.shape[1], axis=1)",
                                            "np.tile(k, (1, num_qo_heads // k.shape[1], 1))")], "expand_kv"),
    (25, "MLA's key as kpe ⊕ ckv", [("np.concatenate([ckv, kpe], axis=-1)", "np.concatenate([kpe, ckv], axis=-1)")],
     "MLA's formula"),
    (25, "MLA's value as ckv ⊕ kpe", [("return q, k, k[..., :ckv.shape[-1]]", "return q, k, k")], "v's shape"),
    (25, "both MLA concatenations rotary first", [
        ("np.concatenate([q_nope, q_pe], axis=-1)", "np.concatenate([q_pe, q_nope], axis=-1)"),
        ("np.concatenate([ckv, kpe], axis=-1)[..., None, :]\n    return q, k, k[..., :ckv.shape[-1]]",
         "np.concatenate([kpe, ckv], axis=-1)[..., None, :]\n    return q, k, ckv[..., None, :]")], "ckv first"),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a wrong solution overflows, or makes NaN
@pytest.mark.parametrize("number, mistake, edits, shown", PLANTED, ids=[f"{p[0]:02d}-{p[1]}" for p in PLANTED])
def test_a_planted_wrong_solution_is_rejected(number, mistake, edits, shown, tmp_path):
    exercise = find(number)
    if missing(exercise):
        pytest.skip(missing(exercise))
    source = (SOLUTIONS / exercise.filename).read_text()
    for old, new in edits:
        assert source.count(old) == 1, f"the edit no longer applies to the solution: {old!r}"
        source = source.replace(old, new)
    (tmp_path / exercise.filename).write_text(source)
    result = grade(exercise, tmp_path)
    assert result.status == "fail", f"{mistake} passed exercise {number}"
    assert shown in f"{result.case} {result.detail}", f"{mistake}: rejected at {result.case}: {result.detail}"


# ---- the command line ---------------------------------------------------------------------------------------------

def test_start_copies_the_stubs_and_keeps_a_learners_files(tmp_path):
    folder = tmp_path / "mine"
    assert run("start", str(folder))[0] == 0
    assert sorted(p.name for p in folder.glob("ex*.py")) == sorted(e.filename for e in EXERCISES)
    (folder / "ex01_lse.py").write_text((SOLUTIONS / "ex01_lse.py").read_text())
    (folder / "ex02_merge.py").unlink()
    code, out = run("start", str(folder))
    assert code == 0 and f"copied 1 stub into {folder}; kept the {len(EXERCISES) - 1}" in out
    assert (folder / "ex01_lse.py").read_text() == (SOLUTIONS / "ex01_lse.py").read_text()
    code, out = run("check", "--dir", str(folder), "1", "2")
    assert code == 1 and statuses(out) == {1: ("lse", "pass"), 2: ("merge", "fail")}, out
    assert run("check", "--dir", str(folder), "1")[0] == 0


def test_check_grades_the_default_folder_when_there_is_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("start")[0] == 0 and (tmp_path / DEFAULT_DIR / "ex06_causal_mask.py").is_file()
    (tmp_path / DEFAULT_DIR / "ex06_causal_mask.py").write_text((SOLUTIONS / "ex06_causal_mask.py").read_text())
    code, out = run("check", "6", "7")
    assert out.splitlines()[0] == f"grading {DEFAULT_DIR}"
    assert code == 1 and statuses(out) == {6: ("causal-mask", "pass"), 7: ("sliding-window", "fail")}, out
    (tmp_path / DEFAULT_DIR / "ex07_sliding_window.py").unlink()
    code, out = run("check", "7")
    assert code == 1 and "ex07_sliding_window.py is missing" in out and "start" in out


def test_show_prints_the_statement():
    code, out = run("show", "9")
    assert code == 0 and find(9).statement in out and "notebooks/06_kv_pruning_quest.py" in out


@pytest.mark.parametrize("argv", [["check", "99"], ["check", "--dir", "no-such-folder"], ["show", "0"],
                                  ["check", "--dir", ".", "--solutions"], ["grade"]], ids=" ".join)
def test_a_usage_error_exits_with_2(argv, capsys):
    assert run(*argv)[0] == 2
    assert "error:" in capsys.readouterr().err


def test_the_module_runs_and_exits_with_the_result(tmp_path):
    """The real entry point, in a fresh interpreter: ``python -m bsrattn.exercises`` and its exit codes."""
    ok = subprocess.run([sys.executable, "-m", "bsrattn.exercises", "check", "--solutions", "1", "3"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and statuses(ok.stdout) == {1: ("lse", "pass"), 3: ("page-table", "pass")}, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "bsrattn.exercises", "check", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "NotImplementedError" in bad.stdout, bad.stderr


def test_importing_the_course_imports_no_gpu_package():
    code = ("import sys, bsrattn.exercises, bsrattn.exercises.cli; "
            "print(sorted(m for m in ('numba', 'triton', 'torch') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_ends_with_its_exercises(path):
    cells = re.split(r"^# %%", path.read_text(), flags=re.MULTILINE)
    last = cells[-1]
    assert last.startswith(" [markdown]") and "# ## Exercises" in last, f"{path.name} does not end with Exercises"
    listed = [int(n) for n in re.findall(r"python -m bsrattn\.exercises check (\d+)`", last)]
    assert listed == [e.number for e in EXERCISES if e.notebook == path.stem], listed
    for number in listed:
        assert f"Exercise {number}, **{find(number).name}**" in last
