"""The workbench beside ``bench/``: kernel prototypes and probes that no default engine path
runs, kept runnable (``bench.kernels --compare mosaic`` / ``mosaic_t`` time them) and tested
(tests/lab/) until they are promoted into ``jfp8kv`` or deleted. ``jfp8kv`` never imports
``lab``; what the prototypes taught is in docs/lab/kernels-notes.md ("The lab")."""
