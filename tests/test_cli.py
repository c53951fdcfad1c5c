"""What the command line prints: readable help, and the real reason when nothing can be planned."""

import pytest

from hybridsp.__main__ import build_parser, main


def test_plan_help_has_no_markup(capsys):
    parser = build_parser()
    plan = parser._subparsers._group_actions[0].choices["plan"]
    text = plan.format_help()
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert "rank Ulysses x ring x DP x ZeRO plans" in text


def test_plan_names_the_degree_that_divides_nothing(capsys):
    main(
        [
            "plan",
            "--model",
            "llama3-8b",
            "--nodes",
            "1",
            "--gpus-per-node",
            "6",
            "--ulysses",
            "4",
            "--seq-len",
            "100000",
        ]
    )
    out = capsys.readouterr().out
    assert "not a memory problem" in out and "must each divide 6" in out
    assert "No plan fits in memory" not in out


@pytest.mark.parametrize(
    "option, value",
    [
        ("--memory-gib", "0"),
        ("--heads", "0"),
        ("--head-dim", "0"),
        ("--vocab", "0"),
        ("--layers", "0"),
        ("--host-memory-gib", "0"),
        ("--flops", "inf"),
        ("--flops", "nan"),
        ("--seq-len", "-8"),
        ("--nodes", "0"),
    ],
)
def test_plan_refuses_zero_and_infinite_numbers(capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama3-8b", "--seq-len", "8192", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: expected a positive" in capsys.readouterr().err


def test_plan_needs_head_dim_when_heads_do_not_divide_hidden(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "plan",
                "--seq-len",
                "8192",
                "--heads",
                "8",
                "--hidden",
                "500",
                "--intermediate",
                "1024",
                "--layers",
                "2",
                "--vocab",
                "100",
            ]
        )
    assert "--hidden 500 is not a multiple of --heads 8: give --head-dim" in str(exit_info.value)
