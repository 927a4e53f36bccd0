"""`python -m hpcscale` is the `hpcscale` command (mpirun starts ranks this way, with the same interpreter)."""

from hpcscale.cli.entry import main

main()
