"""Intermediate-layer distillation methods, one module each: TinyBERT, PKD, MiniLM.

A method named ``<name>`` is two things with that one name:

* the config section ``objective.<name>`` (a dataclass field of ``ObjectiveConfig`` in
  ``trainer/config.py``, listed in ``ObjectiveConfig.LAYER_METHODS``), and
* the module ``trainer/objective/layer_methods/<name>.py``, which exposes ``Method``, a subclass of
  :class:`trainer.objective.layer_methods.base.LayerMethod` owning the method's layer map, what it
  captures, its learned projections and its loss.

``trainer.objective.layer_distillation.LayerDistillation`` imports ``Method`` by that name, builds
it when the section has a positive weight and adds its terms to the objective. A new method is
therefore one new file here plus its section in ``trainer/config.py``; nothing else changes.
"""
