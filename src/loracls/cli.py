"""The `loracls` command: a few lines per command, each calling the library."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from loracls.cli_data import data_app, select
from loracls.cli_options import (
    INT8,
    LONG_TEXTS,
    MIN_CONFIDENCE,
    STRIDE,
    UNFINISHED,
    HelpCommand,
    LongTexts,
    check_run_folder,
    config_options,
    fail,
    print_version,
    quiet_libraries,
    stops_cleanly,
)
from loracls.config import PromptConfig, TrainConfig, parse_overrides, read_yaml_config
from loracls.console import int8_line, per_class_table, results_table, sweep_plan_table
from loracls.errors import LoraclsError

app = typer.Typer(
    help="Fine-tune a small decoder-only LM as a text classifier with LoRA.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help that fits the terminal (`HelpCommand`)
)
console = Console()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=print_version, is_eager=True, help="Print the versions and exit"),
    ] = False,
) -> None:
    """Runs before a command's own options are read: it loads nothing (see `quiet_libraries`)."""


@app.command(cls=HelpCommand)
@config_options
def train(
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value config overrides")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="YAML file of config keys")] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue this unfinished run from its last checkpoint")
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Start again in --out when it holds an unfinished run that no process writes"
        ),
    ] = False,
    **options,
) -> None:
    """Fine-tune with LoRA, validate as it goes, and report on the test split."""
    from loracls.data.tables import check_source

    try:
        given = {k: v for k, v in options.items() if v is not None}
        if resume is not None:
            if given or overrides or config or overwrite:
                raise LoraclsError(
                    f"--resume takes no other options: the run continues with {resume}/config.yaml"
                )
            check_run_folder(resume)
        else:
            cfg = TrainConfig.load(config, {**given, **parse_overrides(overrides or [])})
            for source in (cfg.data, cfg.val, cfg.test):
                if source is not None:
                    check_source(source)
        quiet_libraries()
        from loracls.training.train import print_outcome
        from loracls.training.train import resume as resume_run
        from loracls.training.train import train as run_train

        run, metrics = resume_run(resume) if resume is not None else run_train(cfg, overwrite)
    except LoraclsError as e:
        fail(e)
    if not run.main:  # under several processes, the main one reports
        return
    print_outcome(run, metrics)


@app.command(cls=HelpCommand)
@stops_cleanly("nothing was written")
@config_options(
    only=PromptConfig,
    names={
        "baseline_shots": ["--shots"],
        "prompt_template": ["--template"],
        "prompt_instruction": ["--instruction"],
    },
)
def baseline(
    data: Annotated[str, typer.Option(help="A labelled file (scored in full) or a built-in dataset")],
    model: Annotated[str, typer.Option(help="Model alias, folder, .gguf file or hub id")] = TrainConfig.model,
    split: Annotated[str, typer.Option(help="Split of a built-in dataset: train, val or test")] = "test",
    train: Annotated[str | None, typer.Option(help="Labelled file to draw --shots from")] = None,
    max_examples: Annotated[int | None, typer.Option(help="Score a stratified sample of this size")] = None,
    max_length: Annotated[int, typer.Option(help="Tokens kept of each text")] = TrainConfig.max_length,
    text_column: Annotated[str, typer.Option(help="Text column of a file")] = TrainConfig.text_column,
    label_column: Annotated[str, typer.Option(help="Label column of a file")] = TrainConfig.label_column,
    out: Annotated[Path | None, typer.Option(help="Write baseline_metrics.json and predictions here")] = None,
    seed: Annotated[int, typer.Option(help="Seed for the shots and the built-in splits")] = TrainConfig.seed,
    **options,
) -> None:
    """Score the base model with a prompt alone (zero- or few-shot), the figure a fine-tune must beat."""
    from loracls.data.tables import check_source

    try:
        given = {k: v for k, v in options.items() if v is not None}
        cfg = TrainConfig(
            model=model,
            data=data,
            seed=seed,
            max_eval_examples=max_examples,
            max_length=max_length,
            text_column=text_column,
            label_column=label_column,
            **given,
        )
        for source in (data, train):
            if source is not None:
                check_source(source)
        quiet_libraries()
        from loracls.model import load_tokenizer, resolve_model
        from loracls.training.baseline import baseline_line, baseline_on_device, load_baseline_data

        table, shots_from, labels = load_baseline_data(data, split, train, cfg)
        path = resolve_model(model)
        tokenizer = load_tokenizer(path)
        metrics = baseline_on_device(path, cfg, tokenizer, table, labels, shots_from, out)
    except LoraclsError as e:
        fail(e)
    console.print(baseline_line(metrics), soft_wrap=True)
    console.print(
        f"{len(table)} examples in {metrics['wall_s']:.1f} s" + (f"; written to {out}" if out else "")
    )


@app.command("eval", cls=HelpCommand)
@stops_cleanly("nothing was written")
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="A finished run folder")],
    data: Annotated[str | None, typer.Option(help="A labelled file; default: the run's test split")] = None,
    long_texts: Annotated[LongTexts | None, LONG_TEXTS] = None,
    stride: Annotated[int | None, STRIDE] = None,
    allow_unfinished: Annotated[bool, UNFINISHED] = False,
    int8: Annotated[bool, INT8] = False,
) -> None:
    """Evaluate a run's best checkpoint on its test split or on another labelled file."""
    from loracls.data.tables import check_source

    try:
        check_run_folder(run_dir)
        if data is not None:
            check_source(data)
        quiet_libraries()
        from loracls.inference.predict import evaluate_run

        how = long_texts.value if long_texts else None
        metrics, out = evaluate_run(run_dir, data, allow_unfinished, int8, how, stride)
    except LoraclsError as e:
        fail(e)
    console.print(
        f"[bold]accuracy {metrics['accuracy']:.4f}  macro-F1 {metrics['macro_f1']:.4f}[/] on {metrics['n']} "
        f"examples"
    )
    console.print(per_class_table(metrics))
    console.print(f"written to {out}", soft_wrap=True)


@app.command(cls=HelpCommand)
@stops_cleanly("nothing was written")
def predict(
    path: Annotated[Path, typer.Argument(help="A finished run folder or an export folder")],
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to classify")] = None,
    input: Annotated[
        Path | None, typer.Option("--input", help="A file of texts, in any format --data reads")
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", help="Write .jsonl or .csv here")] = None,
    text_column: Annotated[str | None, typer.Option(help="Text column of --input")] = None,
    generate: Annotated[
        bool, typer.Option(help="Also write what an `objective: lm` model says (greedy) as `response`")
    ] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens --generate writes at most", min=1)] = 64,
    min_confidence: Annotated[float | None, MIN_CONFIDENCE] = None,
    long_texts: Annotated[LongTexts | None, LONG_TEXTS] = None,
    stride: Annotated[int | None, STRIDE] = None,
    allow_unfinished: Annotated[bool, UNFINISHED] = False,
    int8: Annotated[bool, INT8] = False,
) -> None:
    """Classify texts given as arguments or in a file; prints JSON lines unless --output is set. The input
    file's other columns (ids, metadata) come first in each result, so that it joins back."""
    from loracls.data.tables import check_source
    from loracls.inference.export_format import folder_kind

    try:
        if bool(texts) == bool(input):
            raise LoraclsError("Give texts as arguments or --input FILE (one of the two)")
        folder_kind(path)
        if input is not None:
            check_source(input)
        quiet_libraries()
        from loracls.inference.predict import Classifier
        from loracls.inference.predictions import prediction_lines, read_texts, write_predictions

        classifier = Classifier.load(path, allow_unfinished=allow_unfinished, int8=int8)
        classifier.read_long_texts(long_texts.value if long_texts else None, stride)
        if classifier.int8:
            console.print(int8_line(classifier.int8), soft_wrap=True)
        column = text_column or classifier.text_column
        frame = None
        if input is not None:
            frame, texts = read_texts(input, column)
        responses = classifier.generate(texts, max_new_tokens, "generate") if generate else None
        records = classifier.predict(texts, "predict", min_confidence)
        if responses is not None:
            records = [r | {"response": x} for r, x in zip(records, responses, strict=True)]
    except LoraclsError as e:
        fail(e)
    if min_confidence is not None:
        unsure = sum(r["abstained"] for r in records)
        console.print(f"{unsure} of {len(records)} texts below --min-confidence {min_confidence}: no label")
    if output is None:
        for line in prediction_lines(records, frame, column):
            sys.stdout.write(line + "\n")
        return
    write_predictions(output, records, frame, column)
    console.print(f"{len(records)} predictions written to {output}")


app.add_typer(data_app, name="data")
app.command(cls=HelpCommand)(select)


@app.command(cls=HelpCommand)
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts and verdicts as JSON")] = False,
    smoke: Annotated[bool, typer.Option(help="Run real kernels on the device in a child process")] = True,
    model: Annotated[str | None, typer.Option(help="Estimate training memory for this model")] = None,
    batch_size: Annotated[int, typer.Option(help="Micro-batch for the memory estimate")] = 16,
    max_length: Annotated[int, typer.Option(help="Tokens per text for the memory estimate")] = 256,
    devices: Annotated[int, typer.Option(help="Devices FSDP would shard over, for the estimate")] = 8,
) -> None:
    """Check the GPU stack (ROCm, CUDA) or CPU: versions, architectures, overrides, a smoke test, memory."""
    from loracls.environment.devices import free_memory_gb
    from loracls.environment.doctor import checkup, print_checkup

    found = checkup(smoke)
    if found.facts.torch:
        found.memory["free_gb"] = free_memory_gb()
    try:
        if model:
            quiet_libraries()
            from loracls.environment.memory import memory_estimate

            precision = "bf16" if found.device == "cuda" else "fp32"
            found.memory["estimate"] = memory_estimate(model, batch_size, max_length, precision, devices)
    except LoraclsError as e:
        fail(e)
    if as_json:
        sys.stdout.write(json.dumps(found.to_json(), indent=2) + "\n")
    else:
        print_checkup(found, console, devices)
    raise typer.Exit(0 if found.can_train else 1)


@app.command(cls=HelpCommand)
def targets(
    model: Annotated[str, typer.Option(help="Model alias, folder, .gguf file or hub id")] = TrainConfig.model,
    target_modules: Annotated[
        str,
        typer.Option("--target-modules", "--preset", help="Preset (attn-qv, attn, all-linear), names, regex"),
    ] = TrainConfig.target_modules,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank (unset: as training sets it)")] = None,
    num_labels: Annotated[int, typer.Option(help="Number of classes (sizes the head)")] = 2,
    allow_few_targets: Annotated[bool, typer.Option(help="Do not refuse small selections")] = False,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow the model's own code")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON")] = False,
) -> None:
    """Show which modules would get LoRA and what would be trained, without loading weights or training."""
    quiet_libraries()
    from loracls.lora import plan_for_model, resolve_capacity, targets_line, targets_table

    try:
        cfg = TrainConfig(model=model, target_modules=target_modules, lora_r=lora_r)
        if (chosen := resolve_capacity(cfg, num_labels)) and not as_json:  # --json: the plan alone
            console.print(chosen)
        target_modules, rank = cfg.target_modules, cfg.lora_r
        plan = plan_for_model(model, target_modules, rank, num_labels, allow_few_targets, trust_remote_code)
    except LoraclsError as e:
        fail(e)
    if as_json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
        return
    console.print(targets_table(plan, f"{model}: {target_modules}"))
    console.print(targets_line(plan))


@app.command(cls=HelpCommand)
@stops_cleanly("nothing was written (the partial export folder was removed)")
def export(
    run_dir: Annotated[Path, typer.Argument(help="A finished run folder")],
    out: Annotated[Path, typer.Option("--out", help="The folder to write")],
    adapter_only: Annotated[bool, typer.Option(help="Write the LoRA adapter and head only")] = False,
    allow_unfinished: Annotated[bool, UNFINISHED] = False,
    int8: Annotated[
        bool,
        typer.Option(
            help="Also check the int8 CPU path against fp32 on the test split and keep its calibration "
            "(then `--int8` on the export only quantises)"
        ),
    ] = False,
) -> None:
    """Write a standalone classifier (LoRA merged; loads with plain transformers; an `objective: lm` run: a
    causal LM) or the adapter alone."""
    from loracls.inference.export_format import read_export_info, reads_texts

    try:
        check_run_folder(run_dir)
        quiet_libraries()
        from loracls.inference.export import export_run
        from loracls.objective import objective_kind

        folder = export_run(run_dir, out, adapter_only, allow_unfinished, int8)
    except LoraclsError as e:
        fail(e)
    info = read_export_info(folder)
    kind = objective_kind(info.get("objective", "head")).exported
    console.print(f"{'adapter' if adapter_only else kind} written to {folder}", soft_wrap=True)
    merged_into = info.get("merged_into")
    if merged_into:
        console.print(f"note: LoRA merged into {merged_into}", soft_wrap=True)
    if info.get("int8"):
        console.print(int8_line(info["int8"]), soft_wrap=True)
    console.print(reads_texts(info), soft_wrap=True, highlight=False)


@app.command(cls=HelpCommand)
def serve(
    paths: Annotated[
        list[str],
        typer.Argument(help="A finished run or export folder; several ([NAME=]PATH) share one base model"),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8000,
    max_batch: Annotated[int, typer.Option(help="Texts in one forward pass at most", min=1)] = 32,
    max_wait_ms: Annotated[
        float, typer.Option(help="Wait this long for more texts to fill a batch", min=0)
    ] = 5.0,
    pass_size: Annotated[
        int | None,
        typer.Option(help="Texts per forward pass at most (default: --max-batch)", min=1),
    ] = None,
    pass_tokens: Annotated[
        int | None,
        typer.Option(
            help="Padded tokens per forward pass at most (default: none on a GPU, 512 on a CPU; 0: none)",
            min=0,
        ),
    ] = None,
    max_texts: Annotated[int, typer.Option(help="Texts in one request at most (413 above)", min=1)] = 64,
    max_chars: Annotated[
        int, typer.Option(help="Characters in one text at most (413 above)", min=1)
    ] = 20_000,
    max_queue: Annotated[int, typer.Option(help="Texts waiting at most (503 above)", min=1)] = 1024,
    body_timeout: Annotated[
        float, typer.Option(help="Seconds a request's body may take to arrive (408 after)", min=0.1)
    ] = 10.0,
    precision: Annotated[str, typer.Option(help="auto, fp32 or bf16")] = "auto",
    min_confidence: Annotated[float | None, MIN_CONFIDENCE] = None,
    allow_unfinished: Annotated[bool, UNFINISHED] = False,
    int8: Annotated[bool, INT8] = False,
) -> None:
    """Serve classifiers over HTTP: POST /classify (vLLM's API), /predict, GET /health, /ready, /metrics."""
    from loracls.inference.export_format import named_paths

    if precision not in ("auto", "fp32", "bf16"):
        fail(LoraclsError(f"--precision must be auto, fp32 or bf16, not {precision!r}"))
    if int8 and precision == "bf16":
        fail(LoraclsError("--int8 runs the rest of the model in fp32; drop --precision bf16"))
    try:
        named = named_paths(paths)
    except LoraclsError as e:
        fail(e)
    quiet_libraries()
    try:
        from loracls.environment.cpu import check_int8_cpu, emulated_bf16_warning
        from loracls.environment.devices import inference_device
        from loracls.inference.serve import serve as run_server
        from loracls.inference.serve_limits import ServeLimits
    except ImportError as e:
        fail(
            LoraclsError(f"loracls serve needs its extra ({e.name} is missing): pip install 'loracls[serve]'")
        )
    slow = emulated_bf16_warning(precision, inference_device().type)
    if slow:
        console.print(f"[yellow]{slow}[/]", soft_wrap=True)
    limits = ServeLimits(
        max_batch=max_batch,
        pass_size=pass_size,
        pass_tokens=pass_tokens,
        max_wait_ms=max_wait_ms,
        max_texts=max_texts,
        max_chars=max_chars,
        max_queue=max(max_queue, max_texts),
        body_timeout=body_timeout,
        min_confidence=min_confidence,
    )
    try:
        if int8:
            check_int8_cpu()
        code = run_server(named, host, port, limits, precision, allow_unfinished, int8)
    except LoraclsError as e:
        fail(e)
    raise typer.Exit(code)


@app.command(cls=HelpCommand)
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="One or more run folders")],
    out: Annotated[Path, typer.Option(help="Comparison page, written when several runs are given")] = Path(
        "compare.html"
    ),
    allow_unfinished: Annotated[bool, UNFINISHED] = False,
) -> None:
    """Rebuild RUN/report.html (and RUN/plots/) for each run; for several runs, also a comparison page."""
    try:
        for run_dir in run_dirs:
            check_run_folder(run_dir)
        from loracls.training.report import build_report, compare_runs
        from loracls.training.runs import RunFolder

        for run_dir in run_dirs:
            RunFolder(run_dir).check_finished(allow_unfinished)
        for run_dir in run_dirs:
            console.print(f"report: {build_report(run_dir)}", soft_wrap=True)
        if len(run_dirs) > 1:
            finished = [r for r in run_dirs if RunFolder(r).status() == "finished"]
            console.print(
                f"comparison of {len(finished)} runs: {compare_runs(finished, out)}", soft_wrap=True
            )
    except LoraclsError as e:
        fail(e)


@app.command(cls=HelpCommand)
def sweep(
    config: Annotated[Path, typer.Option("--config", help="Sweep file: out, base, grid and/or runs")],
    dry_run: Annotated[bool, typer.Option(help="List the runs without training")] = False,
) -> None:
    """One run per point of a grid over config keys; finished points are skipped, unfinished ones resume."""
    try:
        read_yaml_config(config)
        quiet_libraries()
        from loracls.training.sweep import load_sweep, run_sweep

        out, points = load_sweep(config)
        console.print(sweep_plan_table(points, out))
        if dry_run:
            return
        out, results, failed = run_sweep(config)
    except LoraclsError as e:
        fail(e)
    if not results.empty:
        console.print(results_table(results, f"{out}/results.csv"))
    console.print(f"results, plots and compare.html in {out}", soft_wrap=True)
    if failed:
        console.print(f"[bold red]{len(failed)} run(s) failed:[/] {', '.join(failed)}")
        raise typer.Exit(1)
