"""tensorcanon inside training frameworks: Lightning, accelerate, transformers.

Each framework has its own module, imported only when you ask for it, so
``import tensorcanon`` never imports a framework:

=========================================  ==============================================
module                                     what it gives
=========================================  ==============================================
``tensorcanon.integrations.lightning``     ``CanonicalCheckpointIO`` (``Trainer(plugins=)``),
                                           ``ExactResume`` (callback: RNG, settings, sampler
                                           position, saveability checked at fit start),
                                           ``load_from_checkpoint`` (no ``torch.load``)
``tensorcanon.integrations.accelerate``    ``save_state`` / ``load_state`` (no pickle
                                           anywhere), ``track`` (counts batches)
``tensorcanon.integrations.transformers``  ``CanonicalTrainer`` (a ``Trainer`` whose
                                           checkpoints hold no pickle)
=========================================  ==============================================

Install the framework (``pip install lightning``), or tensorcanon with the matching extra
(``pip install ".[lightning]"`` in a clone: README.md, "Install").
docs/INTEGRATIONS.md says what each one saves, what you write, how resumption is
proven and where the limits are.
"""
