"""Models built from the operations: chapter 12's GPT (``gpt``), its training (``train``,
``python -m stepkernels.train``) and its data (``data``, ``python -m stepkernels.data``)."""
