"""Code that runs at both ends of a transfer: in hpcscale here, and on another site's bare `python3 -S`.

hpcscale/xsite/bootstrap.py ships these modules (source and bytecode) over ssh, and the remote interpreter
installs them under their own names before it runs the staging agent; the manifest code (hpcscale/data) and
the local side of `hpcscale stage` import the very same modules. So every module here keeps one promise:
standard library only, Python >= 3.8 syntax and library, and no import of hpcscale outside hpcscale.portable
(hpcscale itself is not installed at the other site). This file stays empty but for this docstring: the
remote creates the package as an empty module. tests/stage/test_portable.py checks all of it.
"""
