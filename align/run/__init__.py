"""The run wing: a run directory and its life (``config``, ``cli``, ``presets``, ``build``, ``checkpoint``, ``safety``,
``log``, ``plot``). Nothing is imported here."""
