"""The figures of the README and of the documentation's pages are the committed results: every table a
benchmark writes from its JSON is written again here from the committed JSON and compared with the committed
Markdown, and the tables that quote them (the README's results table, and the benchmark and guide pages under
docs/ that now hold the rest) are checked row by row (or number by number, where a page condenses a table).
A rerun that is committed without the pages, or a page edited by hand, fails here."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hf_meshtune.config import QUALITY_CODEC

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"


def _page(name: str) -> str:
    """A page of the documentation site, ``docs/<name>``."""
    return (DOCS / name).read_text()


def _section(text: str, heading: str) -> str:
    """``text`` from ``heading`` (a whole heading line) to the next heading of the same or a higher level;
    lines inside fenced code blocks (a shell comment starts with ``#`` too) are not headings."""
    level = len(heading.split(" ", 1)[0])
    lines, fenced, start = text.splitlines(), False, None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if start is None and line == heading:
            start = i
        elif start is not None and re.match(rf"#{{1,{level}}} ", line):
            return "\n".join(lines[start:i])
    assert start is not None, f"no heading {heading!r}"
    return "\n".join(lines[start:])


def _rows(text: str) -> list[str]:
    """Table body rows (no header, no separator) of every Markdown table in ``text``."""
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        if i + 1 < len(lines) and set(lines[i + 1]) <= set("|-: ") and lines[i + 1].startswith("|"):
            continue  # a header: the separator follows it
        rows.append(line)
    return rows


def _numbers(text: str) -> list[tuple[float, int]]:
    """(value, decimals) of every number in ``text``; 1.1k reads as 1100 with precision 100."""
    found = []
    for whole, frac, kilo in re.findall(r"(?<![\w.])(\d[\d,]*)(?:\.(\d+))?(k)?", text):
        value = float(whole.replace(",", "") + ("." + frac if frac else ""))
        decimals = len(frac)
        if kilo:
            value, decimals = value * 1000, decimals - 3
        found.append((value, decimals))
    return found


def _rounds_to(value: float, decimals: int, source: list[tuple[float, int]]) -> bool:
    """Some source number agrees with ``value`` to the coarser of the two printed precisions (half a unit
    of the last digit): a page may round a number further, or quote it where the table rounded it."""
    return any(abs(s - value) <= 0.5 * 10.0 ** -min(decimals, d) + 1e-9 for s, d in source)


def test_the_mesh_benchmark_tables_are_its_committed_run():
    from benchmarks.mesh.run import table

    results = json.loads((ROOT / "benchmarks/mesh/results/mesh_3x2.json").read_text())
    written = table(results)
    assert (ROOT / "benchmarks/mesh/results/mesh_3x2.md").read_text().strip() == written.strip()
    quoted = _rows(_section(_page("benchmarks/mesh.md"), "## The mesh command, three ways"))
    for row in _rows(written):
        assert row in quoted, row


def test_the_hosts_benchmark_md_is_its_committed_runs_and_the_hosts_page_quotes_it():
    from benchmarks.hosts.run import ROWS, report

    results = {
        name: json.loads(path.read_text())
        for name in ROWS
        if (path := ROOT / "benchmarks/hosts/results" / f"{name}.json").exists()
    }
    written = report(results)
    assert (ROOT / "benchmarks/hosts/results/results.md").read_text() == written
    page = _page("benchmarks/hosts.md")
    for row in _rows(written):
        assert row in page, row


def test_the_plan_validation_is_the_model_on_the_committed_wan_run():
    from benchmarks.plan.validate import HOST_ROWS, WAN, host_report, predict_host_row, predict_row, report

    wan = json.loads(Path(WAN).read_text())
    rows = [predict_row(wan, name) for name in wan["phases"]["shaped"]]
    written = report(rows, wan["regime"]) + host_report([predict_host_row(name) for name in HOST_ROWS])
    assert (ROOT / "benchmarks/plan/results/validation.md").read_text() == written


def test_the_mesh_governor_table_is_its_committed_run_and_the_mesh_page_quotes_it():
    from benchmarks.mesh.governed import table

    results = json.loads((ROOT / "benchmarks/mesh/results/governed_3x2.json").read_text())
    written = table(results)
    assert (ROOT / "benchmarks/mesh/results/governed_3x2.md").read_text() == written
    quoted = _rows(_section(_page("benchmarks/mesh.md"), "## The governor on the distributed mesh"))
    assert quoted == _rows(written)  # the whole table, row for row


def test_the_memory_benchmark_tables_are_its_committed_run():
    from benchmarks.memory.report import markdown, summary_table

    results = json.loads((ROOT / "benchmarks/memory/results/memory.json").read_text())
    assert (ROOT / "benchmarks/memory/results/memory.md").read_text() == markdown(results)
    quoted = _rows(_section(_page("benchmarks/memory.md"), "# Memory per process"))
    for row in _rows("\n".join(summary_table(results))):
        assert row in quoted, row


def test_the_byte_ledger_table_is_what_meshtune_ledger_prints(capsys):
    from hf_meshtune.cli import main

    assert main(["ledger"]) == 0
    printed = _rows(capsys.readouterr().out)
    quoted = _rows(_section(_page("guides/reports.md"), "## The byte ledger"))
    assert printed and all(row in quoted for row in printed), printed


def test_the_soak_table_is_its_committed_run():
    from benchmarks.reliability.soak import markdown

    summary = json.loads((ROOT / "benchmarks/reliability/results/soak.json").read_text())
    written = markdown(summary)
    assert (ROOT / "benchmarks/reliability/results/soak.md").read_text() == written
    quoted = _rows(
        _section(_page("benchmarks/reliability.md"), "# Reliability soak: scripted faults on emulated links")
    )
    assert _rows(written)[0] in quoted  # the totals
    assert all(row in _rows(written) for row in quoted), quoted  # and every row the page quotes is the run's


WAN = "benchmarks/wan.md"
EQUAL_QUALITY = "## Time to Dense's quality with a longer step budget"


def test_the_wan_report_is_its_committed_run_and_the_wan_page_rounds_its_numbers(tmp_path):
    from benchmarks.wan.run import write_report

    report = json.loads((ROOT / "benchmarks/wan/results/wan.json").read_text())
    write_report(report, tmp_path)
    written = (tmp_path / "wan.md").read_text()
    assert (ROOT / "benchmarks/wan/results/wan.md").read_text() == written
    # the WAN page condenses the main table: every number it prints is one of its row's, rounded
    source = {row.split("|")[1].strip(): row for row in _rows(written)}
    labels = {"torch PowerSGD hook (DDP)": "PowerSGD hook (DDP)"}
    checked = 0
    main_table = _section(_page(WAN), "# WAN benchmark: measured throughput over shaped links").split(EQUAL_QUALITY)[0]
    for row in _rows(main_table):
        label = row.split("|")[1].strip()
        match = next((s for name, s in source.items() if name.startswith(labels.get(label, label))), None)
        if match is None or label in ("", "row"):
            continue
        values = _numbers(match)
        cells = row.split("|")[2:]
        for value, decimals in _numbers("|".join(cells)):
            assert _rounds_to(value, decimals, values), (label, value, match)
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("folder", ["codec_sweep", "arithmetic_lora", "epochs"])
def test_the_quality_sweeps_results_md_is_written_from_their_committed_json(folder):
    import importlib

    module = importlib.import_module(f"benchmarks.quality.{folder}")
    assert (ROOT / "benchmarks/quality" / folder / "results.md").read_text() == module.table()


def test_the_quality_benchmark_results_md_is_written_from_its_committed_json(tmp_path):
    from benchmarks.quality import report

    committed = ROOT / "benchmarks/quality/results"
    shutil.copytree(committed, tmp_path / "results")
    report.write_report(tmp_path / "results")
    for written in sorted((tmp_path / "results").glob("*/results.md")):
        mode = written.parent.name
        assert written.read_text() == (committed / mode / "results.md").read_text(), mode


def _source_row(page_row: str, by_key: dict[tuple[str, str], list[str]]) -> list[str]:
    """The results rows a quality page row of the codec sweep quotes: same boundary and anchor prior, every seed."""
    first, prior = (cell.strip() for cell in page_row.split("|")[1:3])
    code = re.match(r"`([^`]+)`", first)
    boundary = "mask0.95 (zeros)" if first.startswith("`M95") else code.group(1) if code else first
    variant = "refitted" if "refitted" in first else "α = 0.7" if "α = 0.7" in prior else ""
    return [
        row
        for (b, p), rows in by_key.items()
        if b == boundary and p.startswith(prior[:2]) and variant in p
        for row in rows
    ]


def test_the_quality_page_codec_sweep_rows_are_the_committed_runs_rounded():
    """Every number from the B/token column on, in each quality page row of the SmolLM2 sweep, is one of its
    runs' (seed 0, or the seed-1 run the row names), rounded."""
    written = (ROOT / "benchmarks/quality/codec_sweep/results.md").read_text()
    by_key: dict[tuple[str, str], list[str]] = {}
    for row in _rows(written):
        cells = [c.strip() for c in row.split("|")[1:]]
        by_key.setdefault((cells[1].strip("`"), cells[3]), []).append(row)
    section = _section(
        _page("benchmarks/quality.md"), "## Composed boundary codecs on SmolLM2: what keeps dense quality"
    )
    table = _rows(section.split("Read plainly")[0])
    assert len(table) >= 15
    # page cell → results.md column: B/token, compression, dense eval loss after, gap to Dense
    columns = {2: 4, 3: 5, 4: 7, 5: 8}
    for row in table:
        sources = _source_row(row, by_key)
        assert sources, row
        cells = [c.strip() for c in row.split("|")[1:-1]]
        for index, column in columns.items():  # each cell against its own column of its runs
            values = [n for source in sources for n in _numbers(source.split("|")[1:-1][column])]
            for value, decimals in _numbers(cells[index].replace("seed 1", "")):
                assert _rounds_to(value, decimals, values), (row, cells[index], sources)


def test_the_fidelity_tables_are_their_committed_runs_and_the_quality_page_quotes_them():
    """probe.md / probe_tiny.md / governed.md are written again from their committed JSON; every number in the
    quality page's governor section's tables is one of theirs (or of the tiny Llama's results.md), rounded."""
    from benchmarks.quality import fidelity_probe, governed

    folder = ROOT / "benchmarks/quality/fidelity"
    written = {
        "probe.md": fidelity_probe.report(json.loads((folder / "probe.json").read_text())),
        "probe_tiny.md": fidelity_probe.report_tiny(json.loads((folder / "probe_tiny.json").read_text())),
        "governed.md": governed.table(),
    }
    for name, text in written.items():
        assert (folder / name).read_text() == text, name
    tiny = (ROOT / "benchmarks/quality/results/standard/results.md").read_text()  # the tiny Llama's governed row

    def label(row: str) -> str:  # "`outliers8+int8` (default, seeds 0, 1)" → "outliers8+int8"
        return row.split("|")[1].replace("`", "").split(" (")[0].strip()

    source_rows = _rows("\n".join([*written.values(), tiny]))
    section = _section(
        _page("benchmarks/quality.md"), "## The fidelity governor: the anchor measures what each boundary's codec keeps"
    )
    rows = _rows(section)  # the mesh's rows: benchmarks/mesh.md, the test above
    assert len(rows) >= 10
    # page table (by its width) → the source column of each of its cells after the first: the probe's
    # mean cos and gap; governed.md's bytes, ratio, eval loss and gap to the default; the composed table's
    # bytes, compression and the four tasks' eval loss gaps
    columns = {3: [5, 8], 5: [1, 2, 4, 6], 7: [2, 3, 5, 7, 9, 11]}
    for row in rows:  # every cell is its own source row and column's number, rounded
        cells = [c.strip() for c in row.split("|")[1:-1]]
        sources = [
            s for s in source_rows if label(s) == label(row) and len(s.split("|")) - 2 > max(columns[len(cells)])
        ]
        assert sources, row
        for cell, column in zip(cells[1:], columns[len(cells)]):
            values = [n for s in sources for n in _numbers(s.split("|")[1:-1][column])]
            for value, decimals in _numbers(cell):
                assert _rounds_to(value, decimals, values), (row, cell, sources)


def test_the_dp_sweep_md_is_written_from_its_committed_json(tmp_path):
    from benchmarks.wan.dp_sweep import write_report

    report = json.loads((ROOT / "benchmarks/wan/results/dp_sweep.json").read_text())
    write_report(report, tmp_path)
    assert (ROOT / "benchmarks/wan/results/dp_sweep.md").read_text() == (tmp_path / "dp_sweep.md").read_text()
    # the default's rank and codes are the sweep's row at S = 20 with DiLoCo's outer step, measured there
    from hf_meshtune.config import DEFAULT_DP_POWERSGD_RANK, DEFAULT_DP_QUANTIZE, MeshConfig

    config = MeshConfig()
    assert (config.dp_powersgd_rank, config.dp_quantize) == (DEFAULT_DP_POWERSGD_RANK, DEFAULT_DP_QUANTIZE)
    row = report["rows"][f"dp_r{DEFAULT_DP_POWERSGD_RANK}_{DEFAULT_DP_QUANTIZE}"]["row"]
    assert (row["powersgd_rank"], row["dp_quantize"], row["sync_every"]) == (128, "int8", 20)


def test_the_dp_sweep_refuses_a_variant_it_does_not_have(capsys):
    from benchmarks.wan.dp_sweep import main

    with pytest.raises(SystemExit) as exit_:
        main(["--only", "dense,dp_r5"])
    assert exit_.value.code == 2
    assert "--only ['dp_r5']: name variants of ['dense', 'dp_r4', 'dp_r16'" in capsys.readouterr().err


def test_the_equal_quality_tables_are_their_committed_run_and_the_wan_page_quotes_them(tmp_path):
    from benchmarks.wan.equal_quality import DENSE_NAMES, step_times, summarize, write_report

    results = ROOT / "benchmarks/wan/results"
    report = json.loads((results / "equal_quality.json").read_text())
    shaped = step_times(results)
    write_report(report, shaped, tmp_path)
    written = (tmp_path / "equal_quality.md").read_text()
    assert (results / "equal_quality.md").read_text() == written
    # the WAN table's Dense ran again here to the same loss; tuned Dense is the lowest over dp_sweep's lr grid,
    # whose runs ended at the same losses there
    tuned, base = summarize(report, shaped), summarize(report, shaped, "dense")
    assert base["target_eval_loss"] == report["wan_dense_final"]
    # each row's step time is its timing row's, from the file that timed it
    files = {f: json.loads((results / f).read_text()) for f in ("wan.json", "throughput.json")}
    for r in tuned["rows"].values():
        timing = files[r["timed_in"]]
        expected = (timing["phases"]["shaped"] if r["timed_in"] == "wan.json" else timing["rows"])[r["timed_as"]]
        assert r["shaped_step_seconds"] == expected.get("shaped", expected)["step_seconds"]
    sweep = json.loads((results / "dp_sweep.json").read_text())["rows"]
    losses = {name: sweep[name]["eval"]["eval_loss"]["80"] for name in DENSE_NAMES}
    assert tuned["dense_final_losses"] == losses and tuned["target_eval_loss"] == min(losses.values())
    # the WAN page quotes the tuned target's table whole, and no row that is not the run's
    tables = written.split("**Target: ")[1:]
    quoted = _rows(_section(_page(WAN), EQUAL_QUALITY))  # up to the next section
    assert [row for row in quoted if row in _rows(tables[0])] == _rows(tables[0])
    assert all(row in _rows(written) for row in quoted), quoted


def test_equal_quality_counts_the_first_saved_step_at_the_target_and_refuses_bad_budgets(capsys):
    from benchmarks.wan.equal_quality import main
    from benchmarks.wan.run import first_step_at as reached

    curve = {0: 6.2, 10: 1.1, 20: 0.85, 30: 0.84, 40: 0.86}
    assert (reached(curve, 0.85), reached(curve, 0.845), reached(curve, 0.8)) == (20, 30, None)
    with pytest.raises(SystemExit) as exit_:
        main(["--budgets", "80,5"])
    assert exit_.value.code == 2
    assert "--budgets '80,5': give step counts of at least 10" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--rows", "default_ap"])
    assert "--rows ['default_ap']: name synchronous rows timed in" in capsys.readouterr().err


def test_equal_quality_times_a_row_as_the_wan_row_with_its_bytes_and_flops(capsys):
    from benchmarks.wan.equal_quality import main, timed_as

    # the lr and the outer step change neither: timed as the row they change
    assert timed_as("default_lr2e-3") == timed_as("dp_r128_int8_avg_lr2e-3") == "default"
    assert (timed_as("torchft_diloco_lr2e-3"), timed_as("dense_lr4e-3")) == ("torchft_diloco", "dense")
    # an overlapped sync at low priority is timed by the throughput benchmark's variant that runs it
    assert timed_as("dp_r128_int8_avg_lr2e-3_overlap_low") == "default_overlap_keep_low"
    # syncing twice as often, or another rank, sends other bytes: no WAN row was timed with them
    assert timed_as("dp_s10_r128_int8_avg_lr2e-3") is None and timed_as("dp_r64_int8") is None
    with pytest.raises(SystemExit):
        main(["--rows", "default,dp_s10_r128_int8_avg_lr2e-3"])
    assert "--rows ['dp_s10_r128_int8_avg_lr2e-3']: name synchronous rows timed in" in capsys.readouterr().err


def test_the_throughput_md_is_written_from_its_committed_json(tmp_path):
    from benchmarks.wan.throughput import write_report
    from hf_meshtune.config import DEFAULT_DP_POWERSGD_RANK, DEFAULT_DP_QUANTIZE

    report = json.loads((ROOT / "benchmarks/wan/results/throughput.json").read_text())
    write_report(report, tmp_path)
    assert (ROOT / "benchmarks/wan/results/throughput.md").read_text() == (tmp_path / "throughput.md").read_text()
    # it measured the library's default DP, as the WAN page says
    assert report["dp"] == {"rank": DEFAULT_DP_POWERSGD_RANK, "quantize": DEFAULT_DP_QUANTIZE}


def _tables(text: str) -> list[dict[str, str]]:
    """Every body row of every Markdown table in ``text`` as {header: cell}."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"[|\-: ]+", lines[i + 1]) and not set(line) <= set("|-: "):
            header = [c.strip() for c in line.split("|")[1:-1]]
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                found.append(dict(zip(header, (c.strip() for c in row.split("|")[1:-1]))))
    return found


RESULTS = "## Results: the default against Dense"


def test_the_readme_results_table_quotes_the_committed_results():
    """The README's one results table: each cell is its row's number in the named column of the committed
    results (the SmolLM2 codec sweep, the WAN table, the equal-quality table against tuned Dense), rounded."""
    results = ROOT / "benchmarks/wan/results"
    codec = {
        (r["boundary"].strip("`"), r["anchor prior"]): r
        for r in _tables((ROOT / "benchmarks/quality/codec_sweep/results.md").read_text())
        if r["seed"] == "0"
    }
    wan = {r["row"]: r for r in _tables((results / "wan.md").read_text()) if "speedup vs Dense" in r}
    tuned = (results / "equal_quality.md").read_text().split("**Target: ")[1]  # the table against tuned Dense
    assert tuned.startswith("tuned Dense")
    equal = {(r["row"], r["budget (steps)"]): r for r in _tables(tuned)}
    sources = {  # README row (its first cell's start) → its rows in the results
        "Dense": {"codec": codec["dense", "no"], "wan": wan["Dense"], "equal": equal["Dense, lr 0.002", "80"]},
        "the default, ": {"codec": codec[QUALITY_CODEC, "no"]},  # the WAN benchmark has not run it: "–"
        "`outliers8+int8`, the default's numerics": {
            "codec": codec["outliers8+int8", "no"],
            "wan": wan["Default: outliers8+int8"],
            "equal": equal["Default: outliers8+int8", "240"],
        },
        "the same with the replicas averaged": {
            "equal": equal["S=20, r=128, int8, η=1, μ=0 (averaging), lr 0.002", "160"]
        },
        "rotated int4, ": {"codec": codec["outliers8+rot+int4g64e8m0+zstd", "no"]},
        "`preset=\"paper\"`": {"codec": codec["mask0.95 (zeros)", "yes"], "wan": wan["M95+AP (paper)"]},
    }
    columns = {  # README column → (results, their columns)
        "SmolLM2 main job: dense eval loss after (gap to Dense)": ("codec", ["dense eval loss after", "gap to Dense"]),
        "boundary B/token (bf16)": ("codec", ["bf16 B/token/boundary"]),
        "WAN: tokens/s (vs Dense)": ("wan", ["tokens/s", "speedup vs Dense"]),
        "WAN: B/token": ("wan", ["B/token total"]),
        "WAN: eval loss after 80 steps": ("wan", ["final eval loss"]),
        "WAN: time to tuned Dense's 0.7303, s (speedup)": (
            "equal",
            ["time to the target (s)", "speedup at the target"],
        ),
    }
    rows = _tables(_section(README, RESULTS))
    assert [next(k for k in sources if r["row"].startswith(k)) for r in rows] == list(sources)  # every row, once
    checked = 0
    for row in rows:
        source = sources[next(k for k in sources if row["row"].startswith(k))]
        assert set(row) == {"row", *columns}, set(row)
        for column, (kind, names) in columns.items():
            numbers = _numbers(row[column])
            if not numbers:
                assert row[column] == "–", (row["row"], column)  # not measured: says so
                continue
            values = [n for name in names for n in _numbers(source[kind][name])]
            for value, decimals in numbers:
                assert _rounds_to(value, decimals, values), (row["row"], column, row[column], names)
                checked += 1
    assert checked >= 20
