"""What the command line prints: readable help, and the real reason when nothing can be planned."""

from hybridsp.__main__ import build_parser, main


def test_plan_help_has_no_markup(capsys):
    parser = build_parser()
    plan = parser._subparsers._group_actions[0].choices["plan"]
    text = plan.format_help()
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert "rank Ulysses x ring x DP x ZeRO plans" in text


def test_plan_names_the_degree_that_divides_nothing(capsys):
    main(["plan", "--model", "llama3-8b", "--nodes", "1", "--gpus-per-node", "6", "--ulysses", "4",
          "--seq-len", "100000"])
    out = capsys.readouterr().out
    assert "not a memory problem" in out and "must each divide 6" in out
    assert "No plan fits in memory" not in out
