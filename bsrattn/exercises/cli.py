"""The command line: ``list``, ``show N``, ``start [DIR]`` and ``check [N ...] [--dir DIR | --solutions]``.

See :mod:`bsrattn.exercises` for the workflow; :func:`main` returns the exit code (0: nothing failed, 1: an
exercise failed, 2: a usage error).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path

from bsrattn.exercises.course import DEFAULT_DIR, EXERCISES, SOLUTIONS, STUBS, find, grade, use_simulators_without_gpu

HEADER = """\
bsrattn's exercises, from the LSE of a row to one tile of a GPU kernel.

  python -m bsrattn.exercises start [DIR]     copy the stubs into DIR (default ./bsrattn-exercises)
  python -m bsrattn.exercises show N          exercise N's statement
  python -m bsrattn.exercises check [N ...]   grade ./bsrattn-exercises (the pristine stubs when it does not exist)
  python -m bsrattn.exercises check --dir DIR grade the copies in DIR; --solutions grades the shipped solutions
"""
WIDTH = 112


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bsrattn.exercises", description=HEADER,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the exercises: number, name, one-line statement")
    show = commands.add_parser("show", help="one exercise's statement, and where its file is")
    show.add_argument("number", type=int)
    start = commands.add_parser("start", help="copy the stubs into a folder of your own (files there are kept)")
    start.add_argument("dir", nargs="?", type=Path, default=DEFAULT_DIR,
                       help=f"the folder (default ./{DEFAULT_DIR})")
    check = commands.add_parser("check", help="grade exercises: a line each, the first failing case and a hint")
    check.add_argument("numbers", nargs="*", type=int, metavar="N", help="the exercises to grade (default: all)")
    source = check.add_mutually_exclusive_group()
    source.add_argument("--dir", type=Path, help=f"grade the copies in DIR (default ./{DEFAULT_DIR} if it exists, "
                                                 f"else the pristine stubs)")
    source.add_argument("--solutions", action="store_true", help="grade the shipped solutions")
    return parser


def _exercises(numbers, parser):
    try:
        return [find(n) for n in numbers] if numbers else list(EXERCISES)
    except KeyError as err:
        parser.error(err.args[0])


def _list() -> int:
    print(HEADER)
    width = max(len(e.name) for e in EXERCISES)
    for e in EXERCISES:
        print(f"{e.number:3d}  {e.name:<{width}}  {e.summary}")
    return 0


def _show(number: int, parser) -> int:
    exercise = _exercises([number], parser)[0]
    mine = DEFAULT_DIR / exercise.filename
    print(f"Exercise {exercise.number}, {exercise.name} (notebooks/{exercise.notebook}.py)\n")
    print(exercise.statement)
    print(f"\nyour file: {mine}" if mine.is_file() else
          f"\nno {mine} here: python -m bsrattn.exercises start copies the stubs")
    return 0


def _start(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    copied = []
    for exercise in EXERCISES:
        target = folder / exercise.filename
        if not target.exists():
            shutil.copyfile(STUBS / exercise.filename, target)
            copied.append(exercise.filename)
    kept = len(EXERCISES) - len(copied)
    print(f"copied {len(copied)} stub{'' if len(copied) == 1 else 's'} into {folder}"
          + (f"; kept the {kept} already there" if kept else ""))
    where = "" if folder == DEFAULT_DIR else f" --dir {folder}"
    print(f"next: edit {folder / EXERCISES[0].filename}, then  python -m bsrattn.exercises check{where} 1")
    return 0


def _indented(label: str, text: str) -> str:
    lines = []
    for i, paragraph in enumerate(text.splitlines() or [""]):
        lead = f"      {label:<6}" if i == 0 else " " * 12
        lines.append(textwrap.fill(paragraph, WIDTH, initial_indent=lead, subsequent_indent=" " * 12,
                                   break_long_words=False, break_on_hyphens=False))
    return "\n".join(lines)


def _check(args, parser) -> int:
    exercises = _exercises(args.numbers, parser)
    if args.solutions:
        folder, label = SOLUTIONS, "the shipped solutions"
    elif args.dir is not None:
        if not args.dir.is_dir():
            parser.error(f"no folder {args.dir}: python -m bsrattn.exercises start {args.dir} makes it")
        folder, label = args.dir, str(args.dir)
    elif DEFAULT_DIR.is_dir():
        folder, label = DEFAULT_DIR, str(DEFAULT_DIR)
    else:
        folder, label = STUBS, (f"the pristine stubs (there is no ./{DEFAULT_DIR} here: "
                                f"python -m bsrattn.exercises start makes your copy)")
    use_simulators_without_gpu()  # before anything imports numba: the scheduler's first plan does
    print(f"grading {label}")
    width = max(len(e.name) for e in exercises)
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for exercise in exercises:
        result = grade(exercise, folder)
        counts[result.status] += 1
        print(f"{exercise.number:3d}  {exercise.name:<{width}}  {result.status}", flush=True)
        if result.status == "skip":
            print(_indented("why", result.case))
        elif result.status == "fail":
            print(_indented("case", result.case))
            print(_indented("wrong", result.detail))
            print(_indented("hint", exercise.hint))
    skipped = f", {counts['skip']} skipped" if counts["skip"] else ""
    print(f"{counts['pass']} of {len(exercises)} pass, {counts['fail']} fail{skipped}")
    return 1 if counts["fail"] else 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); return the exit code.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``python -m bsrattn.exercises``.

    Returns
    -------
    int
        0 when nothing failed, 1 when an exercise failed; a usage error exits with 2 (``SystemExit``).
    """
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "list":
        return _list()
    if args.command == "show":
        return _show(args.number, parser)
    if args.command == "start":
        return _start(args.dir)
    return _check(args, parser)
