"""The data path's runtime: what its patches (one module each, in ``datapath/``) share. Helpers, not
patches: discovery skips ``_``-prefixed packages. See ``datapath/__init__.py`` for the map."""
