"""One CLI convention across commands: --json FILE|-, --report FILE.html, --out, --device, --scheme or --key/--value.

Everything runs in-process through click's CliRunner.
"""

from __future__ import annotations

import json

import click
import pytest
from cli_harness import kvq
from tiny_models import save_tiny_model_dir

from kvq_export.cli import cli
from kvq_export.errors import SchemeError
from kvq_export.presets import PRESETS, TENSOR_FORMATS, scheme_from_formats, tensor_format_names


def one_line_error(proc) -> str:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """An int4 export of a tiny model saved beside it (``tiny-llama``)."""
    from kvq_export.export.exporter import export_model

    root = tmp_path_factory.mktemp("tiny")
    return export_model(save_tiny_model_dir(root / "tiny-llama"), "int4-sym-g32", root / "int4")


# -- help everywhere ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_option_and_argument_is_described(name):
    command = cli.commands[name]
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.hidden or param.help, f"kvq {name} {'/'.join(param.opts)} has no help"
        else:  # click shows no help for an argument: the command's docstring names it
            assert param.name.upper() in (command.help or ""), f"kvq {name}: the docstring does not name {param.name}"
    text = kvq(name, "--help").stdout
    assert "flavour" not in text  # one spelling


def test_the_shared_options_are_spelled_alike():
    spelled: dict[str, set[str]] = {}
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                spelled.setdefault(param.opts[0], set()).add(name)
    assert not {"--output", "--workdir"} & set(spelled)  # hidden, deprecated spellings only
    assert {"generate", "validate", "compare", "serve", "bench", "demo"} <= spelled["--device"]
    assert {"generate", "memory", "schemes", "validate", "plan", "bench", "compare"} <= spelled["--json"]
    assert spelled["--report"] == {"validate"}
    for name in ("--json", "--report", "--device", "--flavor"):  # one type and one check per spelling
        kinds = {(json.dumps(p.type.to_info_dict(), sort_keys=True), getattr(p.callback, "__qualname__", None))
                 for c in cli.commands.values() for p in c.params
                 if name in getattr(p, "opts", ()) and not getattr(p, "hidden", False)}
        assert len(kinds) == 1, (name, kinds)


# -- --json FILE, '-' for stdout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("stdout", [["--json", "-"], ["--json"]])  # a bare --json is '-'
def test_json_dash_is_stdout_and_nothing_else(stdout):
    result = kvq("memory", "--scheme", "q4_0", "--seq-len", "64", *stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["scheme"] == "q4_0"
    assert json.loads(kvq("schemes", *stdout).stdout)["kivi-2"]["residual_length"] == 128


def test_json_file_is_written_and_the_table_still_shown(tmp_path):
    out = tmp_path / "sub" / "memory.json"
    result = kvq("memory", "--scheme", "q4_0", "--seq-len", "64", "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "over sequence length" in result.stdout
    assert json.loads(out.read_text())["seq_len"] == 64
    assert not [p for p in out.parent.iterdir() if p.name != "memory.json"]  # written aside, then renamed


def test_json_and_report_are_refused_inside_an_export(tiny_export):
    line = one_line_error(kvq("memory", "--scheme", "q4_0", "--seq-len", "8", "--json", tiny_export / "x.json"))
    assert "inside the kvq export" in line
    line = one_line_error(kvq("validate", tiny_export, "--report", tiny_export / "r.html"))
    assert "inside the kvq export" in line


@pytest.mark.parametrize("path", ["report.json", "report", "report.html.txt"])
def test_report_is_html_only(tiny_export, tmp_path, path):
    line = one_line_error(kvq("validate", tiny_export, "--report", tmp_path / path))
    assert "--report" in line and ".html" in line and "--json" in line
    assert not (tmp_path / path).exists()


# -- --out, with the old spellings hidden and warning -------------------------------------------------------------
def test_build_output_is_a_deprecated_spelling_of_out(tiny_export, tmp_path):
    result = kvq("build", tiny_export, "--output", tmp_path / "e.engine")
    assert "--output is deprecated; use --out" in result.stderr
    assert "--output" not in kvq("build", "--help").stdout
    line = one_line_error(kvq("build", tiny_export, "--out", tmp_path / "a", "--output", tmp_path / "b"))
    assert "not both --out and --output" in line
    line = one_line_error(kvq("build", tiny_export, "--output", tiny_export / "e.engine"))
    assert "inside the kvq export" in line  # the alias is checked like --out


def test_plan_report_became_json(tmp_path):
    help_text = kvq("plan", "--help").stdout
    assert "--json FILE" in help_text and "--report" not in help_text
    # the old spelling is a hidden alias of --json, never beside it
    line = one_line_error(kvq("plan", "--budget", "4", "--out", tmp_path / "p.json", "--json", tmp_path / "a.json",
                                 "--report", tmp_path / "b.json"))
    assert "not both --json and --report" in line


# -- --flavor(s) -------------------------------------------------------------------------------------------------
def test_unknown_bench_flavor_is_one_line(tmp_path):
    line = one_line_error(kvq("bench", "--schemes", "q4_0", "--flavors", "ort-gqa,nope"))
    assert "unknown flavor 'nope'" in line and "reference" in line


# -- --device ----------------------------------------------------------------------------------------------------
def test_device_maps_to_providers():
    from kvq_export.errors import RuntimeInputError
    from kvq_export.runtime.device import genai_providers, providers_for

    assert providers_for("auto") is None and providers_for("cpu") == ["CPUExecutionProvider"]
    assert genai_providers(None) is None and genai_providers(["CPUExecutionProvider"]) == []
    assert genai_providers(["CUDAExecutionProvider", "CPUExecutionProvider"]) == ["cuda"]
    with pytest.raises(RuntimeInputError, match="allowed: CUDAExecutionProvider, CPUExecutionProvider"):
        genai_providers(["TensorrtExecutionProvider"])


def test_cuda_without_cuda_is_one_line_naming_the_providers(tiny_export):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    line = one_line_error(kvq("generate", tiny_export, "--prompt", "w1", "--device", "cuda"))
    assert "--device cuda" in line and "CPUExecutionProvider" in line


def test_generate_on_cpu_writes_json(tiny_export, tmp_path):
    result = kvq("generate", tiny_export, "--prompt", "w1 w2", "--max-new-tokens", "2", "--device", "cpu",
                    "--json", tmp_path / "g.json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(json.loads((tmp_path / "g.json").read_text())["results"][0]["tokens"]) == 2


# -- --key/--value -----------------------------------------------------------------------------------------------
def test_tensor_formats_come_from_the_presets():
    assert {"fp16", "int8", "q8_0", "q4_0", "q4_0-rot", "fp8", "int2-g32", "int2-ch-g32"} <= set(TENSOR_FORMATS)
    assert TENSOR_FORMATS["q4_0"] == PRESETS["q4_0"][0].key
    assert "kivi-2" not in TENSOR_FORMATS  # a window is not a tensor format
    for name in tensor_format_names():  # each builds a valid scheme, on either side
        assert scheme_from_formats(name, "fp16").key == TENSOR_FORMATS[name]
    mixed = scheme_from_formats("q8_0", "q4_0")
    assert mixed.name == "k-q8_0-v-q4_0" and mixed.to_dict() == {**PRESETS["k-q8_0-v-q4_0"][0].to_dict(),
                                                                "name": "k-q8_0-v-q4_0"}
    with pytest.raises(SchemeError, match="allowed: fp16, int8"):
        scheme_from_formats("q3", "fp16")


def test_key_value_give_the_same_bytes_as_the_preset():
    by_formats = json.loads(kvq("memory", "--key", "q8_0", "--value", "q4_0", "--seq-len", "512", "--json").stdout)
    by_preset = json.loads(kvq("memory", "--scheme", "k-q8_0-v-q4_0", "--seq-len", "512", "--json").stdout)
    assert by_formats["total_bytes"] == by_preset["total_bytes"] and by_formats["scheme"] == "k-q8_0-v-q4_0"
    assert "q4_0-rot" in kvq("memory", "--help").stdout  # the accepted formats are named in help


@pytest.mark.parametrize("args, needle", [
    (["--scheme", "q4_0", "--key", "q8_0", "--value", "q4_0"], "either --scheme or --key/--value"),
    (["--key", "q8_0"], "give both --key and --value"),
    (["--key", "q8_0", "--value", "q3"], "unknown key/value format 'q3'; allowed: fp16"),
    ([], "give a cache scheme"),
])
def test_key_value_errors_are_one_line(args, needle):
    assert needle in one_line_error(kvq("memory", "--seq-len", "8", *args))


# -- kvq compare: a summary, the full log behind --verbose --------------------------------------------------------
def test_compare_prints_a_short_summary(tiny_export):
    result = kvq("compare", tiny_export, tiny_export)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.rstrip().endswith("pass │")]
    assert len(rows) == 3 and "logits" in rows[0]  # logits, the worst key layer, the worst value layer
    assert "match within tolerance" in result.stdout
    verbose = kvq("compare", tiny_export, tiny_export, "--verbose")
    assert verbose.returncode == 0
    assert sum(line.rstrip().endswith("pass │") for line in verbose.stdout.splitlines()) > len(rows)


def test_compare_json_holds_every_output(tiny_export):
    result = kvq("compare", tiny_export, tiny_export, "--json", "-", "--logits-atol", "0", "--logits-rtol", "0")
    data = json.loads(result.stdout)
    logits = next(o for o in data["outputs"] if o["name"] == "logits")
    assert data["passed"] is True and logits["max_abs"] == 0 and logits["passed"]
    assert {o["name"] for o in data["outputs"]} >= {"cache.0.key", "cache.0.value"}


def test_compare_summary_stays_short_when_every_output_misses(tiny_export, tmp_path):
    from kvq_export.export.exporter import export_model

    fp16 = export_model(tiny_export.parent / "tiny-llama", "fp16", tmp_path / "fp16")
    result = kvq("compare", fp16, tiny_export, "--cache-atol", "0", "--cache-rtol", "0")
    assert result.returncode == 1 and "differ beyond tolerance" in result.stderr
    rows = [line for line in result.stdout.splitlines() if line.rstrip().endswith(("pass │", "FAIL │"))]
    assert len(rows) == 3 and all(row.rstrip().endswith("FAIL │") for row in rows[1:])
    layers = json.loads((fp16 / "kvq.json").read_text())["model"]["num_layers"]
    assert f"of {1 + 2 * layers} outputs beyond tolerance" in result.stdout


# -- an option that would change nothing is refused, never silently ignored -----------------------------------------
def _unused_options():
    from hypothesis import strategies as st

    weight = st.sets(st.sampled_from([("--weight-block-size", "64"), ("--weight-asymmetric",),
                                      ("--weight-accuracy-level", "1")]), min_size=1)
    calib = st.sets(st.sampled_from([("--calib-corpus", "britannica"), ("--calib-tokens", "64"),
                                     ("--calib-offset", "0"), ("--calib-method", "absmax"), ("--percentile", "99")]),
                    min_size=1)
    return st.one_of(st.tuples(st.just("weights"), st.sampled_from(["fp32", "fp16", None]), weight),
                     st.tuples(st.just("calibration"), st.sampled_from(["fp16", "kivi-2", "q4_0", "int4-sym-g32"]),
                               calib))


def test_export_options_that_change_nothing_are_refused_before_any_work(tmp_path):
    """--weight-* with unquantized weights, --calib-* with a scheme without static scales: one line, nothing written."""
    from hypothesis import given, settings

    @settings(max_examples=40, deadline=None, database=None)
    @given(case=_unused_options())
    def check(case):
        what, choice, options = case
        args = ["export", "--model", tmp_path / "no-model", "--out", tmp_path / "out"]
        if what == "weights":
            args += ["--scheme", "fp16", *(["--weights", choice] if choice else [])]
        else:
            args += ["--scheme", choice]
        line = one_line_error(kvq(*args, *(x for option in sorted(options) for x in option)))
        assert ("apply to int8/int4 weights only" if what == "weights" else "would change nothing") in line
        assert not (tmp_path / "out").exists()

    check()


def test_validate_refuses_an_empty_prompts_file_unless_greedy_is_off(tiny_export, tmp_path):
    (tmp_path / "p.txt").write_text("\n  \n")
    line = one_line_error(kvq("validate", tiny_export, "--baseline", tiny_export, "--prompts", tmp_path / "p.txt"))
    assert "holds no prompt" in line and "--gen-tokens 0" in line


# -- one command never writes two outputs, or an output and an input, to one file ----------------------------------
SAME_FILE = [  # (command line with {a} and {b} for two paths, the options they are given to)
    (["plan", "--model", "{m}", "--budget", "4", "--out", "{a}", "--json", "{b}"], ("--out", "--json")),
    (["validate", "{e}", "--json", "{a}", "--report", "{b}"], ("--json", "--report")),
    (["validate", "{e}", "--corpus", "{a}", "--json", "{b}"], ("--corpus", "--json")),
    (["validate", "{e}", "--prompts", "{a}", "--report", "{b}"], ("--prompts", "--report")),
    (["calibrate", "--model", "{m}", "--calib-corpus", "{a}", "--out", "{b}"], ("--calib-corpus", "--out")),
    (["plan", "--model", "{m}", "--budget", "4", "--calib-corpus", "{a}", "--out", "{b}"], ("--calib-corpus", "--out")),
    (["bench", "--model", "{m}", "--schemes", "q4_0", "--json", "{a}", "--plot", "{b}"], ("--json", "--plot")),
    (["bench-serve", "{e}", "--out", "{a}", "--plot", "{b}"], ("--out", "--plot")),
]


def test_two_paths_naming_one_file_are_refused_before_any_work(tiny_export, tmp_path):
    """``kvq plan --out p.json --json p.json`` kept the report, lost the scheme; --json over --corpus lost the text."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    model = tmp_path / "no-model"  # never loaded: the refusal comes first
    text = tmp_path / "text.html"
    text.write_text("w1 w2 w3\n")
    (tmp_path / "link.html").symlink_to(text)

    @settings(max_examples=40, deadline=None, database=None)
    @given(case=st.sampled_from(SAME_FILE), spelling=st.sampled_from(["same", "dot", "link"]))
    def check(case, spelling):
        args, (first, second) = case
        other = {"same": text, "dot": tmp_path / "." / "sub" / ".." / text.name, "link": tmp_path / "link.html"}
        (tmp_path / "sub").mkdir(exist_ok=True)
        line = one_line_error(kvq(*[a.format(m=model, e=tiny_export, a=text, b=other[spelling]) for a in args]))
        assert f"{second} {other[spelling]} names the same file as {first}" in line, line
        assert text.read_text() == "w1 w2 w3\n"

    check()
