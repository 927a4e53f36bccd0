"""`hpcscale launch`: bootstrap ranks (mpi4py -> torch.distributed), build the mesh, run the entry point."""
