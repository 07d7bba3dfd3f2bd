"""Limits and prices as people write them, on the pages and in the shell: one parser, bounded to what the
store holds, and a sentence (never a traceback) for anything else."""

import pytest
from click.testing import CliRunner

from llmgw import rules, store
from llmgw.cli.main import main
from llmgw.people import limits


@pytest.mark.parametrize("text", ["1e400", "nan", "NaN", "sNaN", "inf", "-Infinity", "-1", "1e999999999",
                                  "1000000000.000001", "ten", "", "1" * 5000])
def test_an_amount_that_is_not_a_sane_sum_is_refused(text):
    said = r"the budget '.*' is not an amount; write a number of whole units from 0 to 1,000,000,000"
    with pytest.raises(rules.LimitError, match=said):
        rules.parse_money(text, "the budget")


@pytest.mark.parametrize("text", ["abc", "99999999999999999999", "9223372036854775808", "2147483648", "-1", "1.5",
                                  "²", "", "1" * 5000])
def test_a_count_past_what_the_store_holds_is_refused(text):
    with pytest.raises(rules.LimitError, match="rpm is a whole number from 0 to 2,147,483,647"):
        rules.parse_count("rpm", text)


def test_amounts_and_counts_within_bounds_are_kept_exactly():
    assert rules.parse_money("0.25") == 250_000 and rules.parse_money(" 1000000000 ") == 10**15
    assert rules.parse_count("rpm", " 060 ") == 60 and rules.parse_count("rpm", "2147483647") == 2**31 - 1
    with pytest.raises(rules.LimitError, match="from 0 to 2,147,483,647"):
        limits.validate({"tpm": 2**31})  # callers that pass numbers are held to the same bounds
    with pytest.raises(rules.LimitError, match="from 0 to 1,000,000,000,000,000"):
        limits.validate({"budget": 10**15 + 1})


def test_the_cli_says_what_is_wrong_and_the_largest_values_fit_the_store(store_url):
    runner = CliRunner()

    def limits_set(*args):
        return runner.invoke(main, ["--store", store_url, "limits", "set", "--scope", "cluster", *args])

    for args, said in ((["--budget", "1e400"], "--budget '1e400' is not an amount; write a number of whole units"),
                       (["--budget", "nan"], "--budget 'nan' is not an amount"),
                       (["--rpm", "99999999999999999999"], "--rpm is a whole number from 0 to 2,147,483,647"),
                       (["--tpm", "9223372036854775808"], "--tpm is a whole number from 0 to 2,147,483,647")):
        result = limits_set(*args)
        assert result.exit_code == 1 and said in result.output and "Traceback" not in result.output, result.output
        assert not isinstance(result.exception, (OverflowError, ArithmeticError)), args
    priced = runner.invoke(main, ["--store", store_url, "prices", "set", "m", "--input", "nan", "--output", "1"])
    assert priced.exit_code == 1 and "the input price 'nan' is not an amount" in priced.output
    # The bounds are what both stores hold (rpm and tpm are 32-bit on PostgreSQL).
    result = limits_set("--rpm", "2147483647", "--tpm", "2147483647", "--budget", "1000000000")
    assert result.exit_code == 0, result.output
    engine = store.open_store(store_url)
    with engine.connect() as conn:
        kept = limits.read_all(conn)[("cluster", "")]
    engine.dispose()
    assert (kept.rpm, kept.tpm, kept.budget) == (2**31 - 1, 2**31 - 1, 10**15)
