"""Training presets for ``python -m stepkernels.train --config NAME``: short files of ``name =
value`` lines, each a field of ``stepkernels.models.train.Config``, with comments saying why.
The command reads them as text (``train.read_preset``), never imports or runs them; a file of
your own in the same form works the same way (``--config path/to/file.py``)."""
