"""Run reports (`python -m trainer.report RUN_DIR [RUN_DIR ...] [--out DIR]`): several runs compared in one PNG
figure per quantity and a Markdown table (docs/report.md).

    runs.py      finding run directories (a run, or a folder of runs such as a Hydra sweep), reading their files
    summary.py   each run's figures for the table, its exit state, the overrides that differ between runs
    plots.py     the PNG figures (matplotlib's Agg canvas, no display)
    markdown.py  report.md
    output.py    atomic writes into the report folder
    command.py   the command: arguments, the default report folder, one-line errors
"""
