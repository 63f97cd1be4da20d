"""The tasks bundled with gossipd: name one by its entry point in the config's ``[task]``.

``daemon.tasks.digits:task``
    An MLP classifying scikit-learn's 8x8 digits (needs scikit-learn:
    ``pip install 'gossipd[demo]'``). The training set is sharded by label, so each node of
    a sharded swarm sees only a few classes. Under a millisecond per step on one CPU core.
    Evaluates to ``{"accuracy", "loss"}`` on a fixed test split. Options:

    ============  =======  ====================================
    hidden        64       width of the hidden layer
    lr            0.05     SGD learning rate (momentum 0.9)
    batch_size    32       samples per step
    ============  =======  ====================================

``daemon.tasks.charlm:task``
    A byte-level transformer language model trained on the Python standard library's own
    source (no download; sharded by file, 5% of the files held out). About 15 ms per step on
    one CPU core. Evaluates to ``{"loss", "bits_per_char"}``. Options:

    ============  =======  ====================================
    d_model       64       width of the residual stream
    layers        2        transformer blocks
    heads         4        attention heads (must divide d_model)
    context       64       bytes of context
    lr            3e-3     AdamW learning rate
    batch_size    16       windows per step
    ============  =======  ====================================

Options come from the config's ``[task.options]`` table. An unknown one is an error, so that a
typo does not silently train with the default::

    [task.options]
    d_model = 128
    layers = 4
"""
