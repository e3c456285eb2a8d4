"""The application around the library: the ``whiteformer`` command (:mod:`.cli`), every command's
configuration (:mod:`.config`), training and run directories (:mod:`.train`), the offline data sets
(:mod:`.data`), the demo, the shipped configs and the ECAttention toy experiment.

The library (``ops``, ``attention``, ``layers``, ``models``, ``analysis``, ``compress``, ``hf``)
never imports this package.
"""
__all__: list = []
