"""The demo: the whole pipeline on the bundled corpus, on CPU, and its report. Not engine code.

python -m demo [--quick]          # make demo / make demo-quick: demo/run.py
python -m demo.report runs/demo   # make report: rewrite the report from what a run left
"""
