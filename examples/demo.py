"""meshbook demo: a 4-rank mesh on this machine, driven from one Python process.

Everything here also works from a notebook (``%load_ext meshbook``, then ``%%mesh`` cells);
see notebooks/ for the tutorials.
"""

import time

import meshbook


def main() -> None:
    started = time.perf_counter()
    with meshbook.start(dims={"dp": 2, "tp": 2}) as mesh:
        print(f"started {mesh} in {time.perf_counter() - started:.2f} s\n")

        print(">>> where is everyone?")
        print(mesh.run("(coords, str(device))").result(), "\n")

        print(">>> a collective: every rank contributes its rank number")
        print(mesh.run("x = torch.full((2,), float(rank)); dist.all_reduce(x); x.sum().item()").result(), "\n")

        print(">>> state stays on the ranks between calls (x is still there)")
        print(mesh.run("x * 2", ranks=[0, 2]).result(), "\n")

        print(">>> train a small DDP model; identical log lines from 4 ranks print once")
        mesh.run(MODEL).result()
        mesh.run(TRAIN).result()
        print()

        print(">>> each rank saw different data, yet DDP keeps the replicas identical")
        print(mesh.run("round(sum(p.sum().item() for p in model.parameters()), 5)").result(), "\n")

        print(">>> half the mesh: the ranks with dp == 0")
        print(mesh.slice(dp=0).apply(lambda: f"rank {rank} says hi").result(), "\n")  # noqa: F821

        print(">>> errors come back grouped by identical traceback, with cell line numbers")
        try:
            mesh.run("a = 1\nb = a / (rank % 2)").result()
        except meshbook.RemoteError as err:
            print(err.render())
    print("\nmesh stopped; no process left behind")


MODEL = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(rank)
"""

TRAIN = """
for step in range(1, 31):
    data = torch.randn(32, 16, generator=gen)
    loss = ((model(data) - data.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 10 == 0:
        avg = loss.detach().clone(); dist.all_reduce(avg); avg /= world_size
        print(f"step {step}: mean loss {avg.item():.4f}")
"""

if __name__ == "__main__":
    main()
