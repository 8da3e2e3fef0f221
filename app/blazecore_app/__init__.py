"""The blazecore application: the ``blazecore`` command and what it runs.

It sits on the library (``blazecore``) and its PyTorch adapter (``blazecore_torch``); neither ever imports it.

    cli         the command line: ``blazecore train | bench | info | demo`` (also ``python -m blazecore``)
    train       the training example: a small MoE transformer language model, its train loop and checkpoints
    corpus      the generated corpus the training example learns
    baselines   the PyTorch MoE layers blazecore is compared with (conventional, torch._grouped_mm)
    info        what ``blazecore info`` reports
    bench       the benchmark harness (the checkout's ``bench/`` directory, installed under this name)

Importing this package imports nothing heavy; torch is imported by the modules that need it.
"""
