"""Placing the roles on a cluster (launch.mode=slurm): the node map (nodemap.py), the srun steps (steps.py), the
launcher that runs and watches them inside an allocation (slurm.py), and the sbatch script (sbatch.py)."""
