"""Lightning user patterns (issue 12), all in one launch: every pattern's ``Trainer.fit`` in sequence, as a user's
script would run them, on 2 ranks under fsdp_custom or on one device (``--devices 1``, strategy "auto").

Each pattern is a LightningModule (and callbacks) written as a Lightning user writes it. Rank ``r`` trains on samples
``r, r+N, ...`` through its own DataLoader (a hand-built ``DistributedSampler(shuffle=False)``, Lightning's sampler
off), so every step's global batch is the one-device run's batch and the two must end with the same weights.

``--patterns a,b``: the patterns to run, in this order (default: all of ``PATTERNS``). A name ``base@option`` is
``base`` under one prefetch option (``OPTIONS``); on one device the options change nothing, so ``base`` runs once.
Each rank writes ``{pattern: result}`` to ``--out.rank{N}`` after every pattern (so a launch killed by the watchdog
keeps what it finished) and ``--out.progress`` names the pattern it is in. A result is ``{"ok": True, ...}`` (rank 0:
``state`` final full weights, ``losses`` per-step global losses, and where the pattern has them ``snapshots``,
``values``, ``flags``) or ``{"error": {...}}`` with the exception and the optimizer steps taken before it. An exception
is recorded and the next pattern runs; a pattern that hangs is stopped by a watchdog (``faulthandler``) that prints
every thread's stack and ends the process, so the caller can rerun the patterns after it.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import time
import traceback

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import lightning_fsdp  # noqa: E402,F401  registers "fsdp_custom"
from lightning_fsdp import FSDPStrategy  # noqa: E402
from lightning_fsdp.checkpoint.full import full_model_state_dict  # noqa: E402
from lightning_fsdp.engine import get_engine  # noqa: E402
from lightning_fsdp.shutdown import destroy_process_group  # noqa: E402
from tests.scripts.pretrained_run import tiny_llama  # noqa: E402
from tests.toolbox.lightning_scripts import quiet_trainer  # noqa: E402
from tests.toolbox.models import VOCAB, Block, loss_fn, samples  # noqa: E402

DIM = 5
GLOBAL_BATCH = 6
SAMPLES = 24  # 4 global batches per epoch
LR = 0.1
WATCHDOG_S = 90.0  # a pattern that runs longer than this is hung (a normal one takes a few seconds)
INFERENCE_WATCHDOG_S = 20.0  # rank 0's lone forward of a tiny model: milliseconds

# The prefetch options every execution-order pattern runs under (fsdp side).
OPTIONS = {
    "default": {},
    "forward_prefetch": {"forward_prefetch": True},
    "backward_post": {"backward_prefetch": "BACKWARD_POST"},
    "no_backward_prefetch": {"backward_prefetch": None},
    "no_limit_all_gathers": {"limit_all_gathers": False},
}
ORDER_PATTERNS = ["siamese", "nograd_in_step", "nograd_batch_end", "nograd_before_step", "eval_reverse"]

PATTERNS = [
    "backbone_finetuning",
    "add_param_group",
    "gan_toggle",
    "gan_weight_clip",
    "manual_two_backward",
    "manual_retain_graph",
    "manual_subset_step",
    "manual_accumulate",
    "manual_clip",
    *[f"{p}@{o}" for p in ORDER_PATTERNS for o in OPTIONS],
    "lora",
    "flip_requires_grad",
    "frozen_from_start",
    "try_except_forward",
    "second_trainer",
    "calls_from_callbacks",
    "calls_between_accumulation",
    "calls_between_held_accumulation",
    "rank0_in_full_weights",
    "hf_generate",
    "hf_activation_checkpointing",
    "rank0_inference",  # last: when broken, rank 0 waits in a collective no other rank joins
]


# ------------------------------------------------------------------------------------------------ models
class ReversibleBlocksNet(nn.Module):
    """Embedding, three residual Blocks (one unit each under auto_wrap_policy={Block}), a head; the blocks can run in
    reverse order (the result differs, the same in every process)."""

    def __init__(self, block: type = Block) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([block(DIM, 6), block(DIM, 4), block(DIM, 3)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        h = self.emb(ids)
        for blk in reversed(self.blocks) if reverse else self.blocks:
            h = blk(h)
        return self.head(h)


class Base(L.LightningModule):
    """What most patterns share: the ReversibleBlocksNet, SGD with momentum, losses averaged over all ranks per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = ReversibleBlocksNet()
        self.step_losses: list = []
        self.val_losses: list = []
        self.probes: list = []

    def forward(self, ids: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        return self.net(ids, reverse)

    def global_mean(self, value: torch.Tensor) -> float:
        # Equal batches on every rank: the mean of the ranks' means is the one-device mean.
        return self.all_gather(value.detach()).float().mean().item()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.net(x), y)
        self.step_losses.append(self.global_mean(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


# 1. BackboneFinetuning ---------------------------------------------------------------------------------
class BackboneNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Embedding(VOCAB, DIM), Block(DIM, 6))
        self.head = nn.Sequential(Block(DIM, 4), nn.Linear(DIM, VOCAB))
        self.step_losses: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.head(self.backbone(x)), y)
        self.step_losses.append(self.all_gather(loss.detach()).mean().item())
        return loss

    def configure_optimizers(self):
        # As BackboneFinetuning's documentation asks: only the parameters trainable at the start.
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=LR, momentum=0.9)


# 2. add_param_group by hand ---------------------------------------------------------------------------
class FrozenMiddle(Base):
    def __init__(self) -> None:
        super().__init__()
        self.net.blocks[1].requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)


class UnfreezeAndAdd(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            block = pl_module.net.blocks[1]
            block.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(block.parameters()), "lr": LR / 2})


# 3. GAN with toggle_optimizer (Lightning's basic GAN example, shrunk) ------------------------------------
LATENT = 3


class GAN(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(LATENT, DIM), Block(DIM, 6), nn.Linear(DIM, DIM))
        self.discriminator = nn.Sequential(Block(DIM, 4), nn.Linear(DIM, 2), nn.Tanh(), nn.Linear(2, 1))
        self.step_losses: list = []

    def forward(self, z):
        return self.generator(z)

    def adversarial_loss(self, y_hat, y):
        return nn.functional.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch, batch_idx):
        imgs, z = batch  # z comes with the data: every process draws the same noise for the same sample
        opt_g, opt_d = self.optimizers()

        # train generator
        self.toggle_optimizer(opt_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        # train discriminator
        self.toggle_optimizer(opt_d)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.step_losses.append(
            [self.all_gather(g_loss.detach()).mean().item(), self.all_gather(d_loss.detach()).mean().item()]
        )

    def configure_optimizers(self):
        opt_g = torch.optim.SGD(self.generator.parameters(), lr=LR, momentum=0.9)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=LR, momentum=0.9)
        return [opt_g, opt_d], []


class WeightClippedGAN(GAN):
    """A WGAN-style critic: its weights are clipped after each of its steps, inside training_step. With
    auto_wrap_policy={Block} most of the critic's parameters belong to the root unit."""

    CLIP = 0.15

    def __init__(self) -> None:
        super().__init__()
        self.clipped_values = 0

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        for param in self.discriminator.parameters():
            self.clipped_values += int((param.detach().abs() > self.CLIP).sum())
            param.data.clamp_(-self.CLIP, self.CLIP)


def gan_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, DIM, generator=g) * 0.5 + 1.0, torch.randn(SAMPLES, LATENT, generator=g))


# 4. try/except around a wrapped block's forward ----------------------------------------------------------
class TryExcept(Base):
    def training_step(self, batch, batch_idx):
        try:
            self.net.blocks[0](torch.zeros(2, DIM + 2))  # wrong width: the Block's first Linear raises
        except RuntimeError:
            pass
        return super().training_step(batch, batch_idx)


# 5. manual optimization ----------------------------------------------------------------------------------
class ManualBase(Base):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ManualTwoBackward(ManualBase):
    """Two forwards, each followed by its own backward, one optimizer step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss1 = loss_fn(self.net(x), y)
        self.manual_backward(loss1)
        loss2 = loss_fn(self.net(x.flip(1)), y)
        self.manual_backward(loss2 * 0.5)
        opt.step()
        opt.zero_grad()
        self.step_losses.append([self.global_mean(loss1), self.global_mean(loss2)])


class ManualRetainGraph(ManualBase):
    """Two losses of one forward, two backward passes through the same graph."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        logits = self.net(x)
        loss1 = loss_fn(logits, y)
        loss2 = loss_fn(logits, y.flip(1))
        self.manual_backward(loss1, retain_graph=True)
        self.manual_backward(loss2 * 0.5)
        opt.step()
        opt.zero_grad()
        self.step_losses.append([self.global_mean(loss1), self.global_mean(loss2)])


class ManualSubsetStep(ManualBase):
    """Two optimizers: the blocks' steps every batch, the embedding and head's every second batch (their gradients
    accumulate in between)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_blocks, opt_rest = self.optimizers()
        loss = loss_fn(self.net(x), y)
        self.manual_backward(loss)
        opt_blocks.step()
        opt_blocks.zero_grad()
        if batch_idx % 2 == 1:
            opt_rest.step()
            opt_rest.zero_grad()
        self.step_losses.append(self.global_mean(loss))

    def configure_optimizers(self):
        rest = list(self.net.emb.parameters()) + list(self.net.head.parameters())
        return [
            torch.optim.SGD(self.net.blocks.parameters(), lr=LR, momentum=0.9),
            torch.optim.SGD(rest, lr=LR, momentum=0.9),
        ]


class ManualAccumulate(ManualBase):
    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = loss_fn(self.net(x), y)
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()
        self.step_losses.append(self.global_mean(loss))


CLIP = 0.05


class ManualClip(ManualBase):
    def __init__(self) -> None:
        super().__init__()
        self.norms: list = []  # one device only: the norm before clipping (a guard that clipping is active)

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = loss_fn(self.net(x), y)
        self.manual_backward(loss)
        if self.trainer.world_size == 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.step_losses.append(self.global_mean(loss))


# 6. execution orders --------------------------------------------------------------------------------------
class Siamese(Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.net(x), y) + loss_fn(self.net(x.flip(1)), y)  # two forwards, one backward
        self.step_losses.append(self.global_mean(loss))
        return loss


class NoGradInStep(Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            probe = self.net(x, reverse=True)  # blocks in the other order, before the real forward
        self.probes.append(self.global_mean(probe.mean()))
        return super().training_step(batch, batch_idx)


class NoGradBatchEnd(Base):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        with torch.no_grad():
            probe = self(batch[0], reverse=True)
        self.probes.append(self.global_mean(probe.mean()))


class NoGradBeforeStep(Base):
    """A no-grad forward after backward, before the optimizer step (e.g. a metric of the model being updated)."""

    def training_step(self, batch, batch_idx):
        self._x = batch[0]
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        with torch.no_grad():
            probe = self(self._x, reverse=True)
        self.probes.append(self.global_mean(probe.mean()))


class EvalReverse(Base):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(self.global_mean(loss_fn(self.net(x, reverse=True), y)))


ORDER_MODULES = {
    "siamese": Siamese,
    "nograd_in_step": NoGradInStep,
    "nograd_batch_end": NoGradBatchEnd,
    "nograd_before_step": NoGradBeforeStep,
    "eval_reverse": EvalReverse,
}


# 7. LoRA ----------------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.3)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoRABlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = LoRALinear(dim, hidden)
        self.fc2 = LoRALinear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class LoRA(Base):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = ReversibleBlocksNet(block=LoRABlock)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=LR, momentum=0.9)


# 8. requires_grad flipped by the user -------------------------------------------------------------------------
def block_state(trainer, module, prefix: str) -> dict:
    """Full tensors of ``module``'s entries under ``prefix`` (every rank calls this: it gathers)."""
    return {k: v for k, v in gather_state(trainer, module).items() if k.startswith(prefix)}


class FlipRequiresGrad(Base):
    """Block 0 frozen for epoch 1 only: no gradient, no update while frozen (its momentum must not move it)."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshots: dict = {}
        self.flags: dict = {}

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.net.blocks[0].requires_grad_(False)
        if self.current_epoch == 2:
            self.net.blocks[0].requires_grad_(True)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.current_epoch == 1:
            grads = [p.grad is None for p in self.net.blocks[0].parameters()]
            self.flags[f"epoch1 batch{batch_idx}: frozen block has no grad"] = all(grads)

    def on_train_epoch_end(self):
        if self.current_epoch in (0, 1):
            self.snapshots[f"epoch{self.current_epoch}_end"] = block_state(self.trainer, self, "net.blocks.0.")


class FrozenFromStart(Base):
    """Block 0 frozen before fit (its parameters are in the optimizer), unfrozen at epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.net.blocks[0].requires_grad_(False)
        self.snapshots: dict = {}
        self.flags: dict = {}

    def on_train_epoch_start(self):
        if self.current_epoch == 1:
            self.net.blocks[0].requires_grad_(True)

    def on_train_epoch_end(self):
        if self.current_epoch == 0:
            opt = self.trainer.optimizers[0]
            params = list(self.net.blocks[0].parameters())
            self.flags["epoch0: frozen block has no grad"] = all(p.grad is None for p in params)
            self.flags["epoch0: frozen block has no optimizer state"] = not any(opt.state.get(p) for p in params)
            self.snapshots["epoch0_end"] = block_state(self.trainer, self, "net.blocks.0.")


# 9. the model after fit ---------------------------------------------------------------------------------------
class Validated(Base):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(self.global_mean(loss_fn(self.net(x), y)))


# 10. calls from outside the steps ------------------------------------------------------------------------------
PROBE_X = samples(SAMPLES).tensors[0][:4]  # fixed inputs a sampling callback feeds the model


def full_weights(trainer):
    """The documented way to run the model on some ranks only: every rank enters ``engine.unsharded()`` (it gathers),
    then a rank may call the model alone. Nothing to do on one device."""
    engine = getattr(trainer.strategy, "engine", None)
    return engine.unsharded() if engine is not None else contextlib.nullcontext()


class CallsEverywhere(L.Callback):
    """Calls the model from the hooks users sample or check in, on every rank, with and without autograd."""

    def _probe(self, pl_module, out) -> None:
        pl_module.probes.append(pl_module.global_mean(out.detach().float().mean()))

    def on_fit_start(self, trainer, pl_module):
        self._probe(pl_module, pl_module.net(PROBE_X))  # a check before training, autograd on as in user code

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            self._probe(pl_module, pl_module.net(PROBE_X))

    def on_train_epoch_end(self, trainer, pl_module):
        net = pl_module.net
        self._probe(pl_module, net(PROBE_X))  # autograd on: nothing calls backward on it
        with torch.no_grad():
            self._probe(pl_module, pl_module(PROBE_X))  # LightningModule.forward called by user code
            h = net.emb(PROBE_X)  # submodules on their own: a root module, then a unit
            self._probe(pl_module, h)
            self._probe(pl_module, net.blocks[1](h))
            self._probe(pl_module, net.head(h))

    def on_validation_epoch_end(self, trainer, pl_module):
        with torch.no_grad():
            self._probe(pl_module, pl_module.net(PROBE_X, reverse=True))


class CallsBetweenAccumulation(L.Callback):
    """With accumulate_grad_batches=2, calls after the first micro-batch's backward, before the optimizer step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx % 2 == 0:
            out = pl_module.net(PROBE_X)  # autograd on
            pl_module.probes.append(pl_module.global_mean(out.detach().mean()))
            with torch.no_grad():
                pl_module.probes.append(pl_module.global_mean(pl_module.net(PROBE_X, reverse=True).mean()))


class Rank0InFullWeights(L.Callback):
    """Rank 0 alone samples several times (as a rank_zero_only callback does) inside the full-weights context."""

    def on_train_epoch_end(self, trainer, pl_module):
        with full_weights(trainer):
            if trainer.is_global_zero:
                with torch.no_grad():
                    for reverse in (False, True, False):
                        pl_module.probes.append(pl_module.net(PROBE_X, reverse=reverse).mean().item())


class HFLlama(Base):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny_llama(tie=False)  # the pretrained tests' model (vocabulary 128 covers VOCAB's ids)

    def forward(self, ids: torch.Tensor, reverse: bool = False) -> torch.Tensor:
        return self.net(input_ids=ids).logits

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self(x), y)
        self.step_losses.append(self.global_mean(loss))
        return loss


class HFLlamaCountingLayerCalls(HFLlama):
    """The Llama, counting its MLPs' calls made while training with gradients: with activation checkpointing each
    decoder layer runs twice per step (forward and recompute), without it once. Eager attention: its mask has the
    query's length, so a recompute that appended to the key/value cache a second time fails instead of attending to
    the keys twice (as sdpa's causal path would, unnoticed)."""

    def __init__(self) -> None:
        super().__init__()
        self.net.set_attn_implementation("eager")
        self.training_mlp_calls = 0
        for layer in self.net.model.layers:
            layer.mlp.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self.training_mlp_calls += 1


class GenerateAtEpochEnd(L.Callback):
    """transformers' generate() in a callback, on every rank, as text samplers do."""

    def on_train_epoch_end(self, trainer, pl_module):
        ids = pl_module.net.generate(PROBE_X[:2, :3], max_new_tokens=4, do_sample=False, eos_token_id=None)
        pl_module.probes.extend(float(t) for t in ids.flatten())


# ------------------------------------------------------------------------------------------------ running
def gather_state(trainer, module) -> dict:
    """The full weights: gathered while the module is sharded (rank 0 keeps them, the other ranks get {}); else,
    on one device or once the engine has handed the module back, its own state_dict()."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None and get_engine(module) is engine:
        return full_model_state_dict(engine)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Runner:
    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.rank = 0
        self.last_trainer: L.Trainer | None = None

    def trainer(self, *, options: dict | None = None, wrap=None, callbacks=(), **kwargs) -> L.Trainer:
        if self.devices > 1:
            strategy = FSDPStrategy(auto_wrap_policy=wrap or {Block}, **(options or {}))
        else:
            strategy = "auto"
        settings = dict(max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
        settings.update(kwargs)
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=self.devices,
            strategy=strategy,
            use_distributed_sampler=False,
            callbacks=list(callbacks),
            **settings,
        )
        assert trainer.world_size == self.devices, (trainer.world_size, self.devices)
        self.rank = trainer.global_rank
        self.last_trainer = trainer  # the steps a failed pattern took are read from its latest Trainer
        return trainer

    @staticmethod
    def loader(trainer: L.Trainer, data=None) -> DataLoader:
        data = samples(SAMPLES) if data is None else data
        # Rank r takes samples r, r+N, ...: every step's global batch is the one-device run's batch.
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=GLOBAL_BATCH // trainer.world_size, sampler=sampler)

    def fit(self, module, trainer, data=None, val: bool = False) -> dict:
        loader = self.loader(trainer, data)
        initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
        trainer.fit(module, loader, loader if val else None)
        result = self.result(trainer, module)
        if self.devices == 1:
            result["ref_only"] = {"initial": initial}  # for the test's guards that each pattern trains what it says
        return result

    @staticmethod
    def result(trainer, module, state: dict | None = None) -> dict:
        state = gather_state(trainer, module) if state is None else state
        out = {"ok": True, "steps": trainer.global_step}
        if trainer.global_rank != 0:
            return out
        out.update(state=state, losses=list(module.step_losses))
        values = {}
        for name in ("val_losses", "probes"):
            if getattr(module, name, None):
                values[name] = list(getattr(module, name))
        if values:
            out["values"] = values
        for name in ("snapshots", "flags"):
            if getattr(module, name, None):
                out[name] = dict(getattr(module, name))
        return out


def run_pattern(name: str, run: Runner) -> dict:
    base, _, option = name.partition("@")
    options = OPTIONS[option] if option else {}
    if base == "backbone_finetuning":
        trainer = run.trainer(max_epochs=3, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
        return run.fit(BackboneNet(), trainer)
    if base == "add_param_group":
        return run.fit(FrozenMiddle(), run.trainer(max_epochs=2, callbacks=[UnfreezeAndAdd()]))
    if base == "gan_toggle":
        return run.fit(GAN(), run.trainer(max_epochs=2), data=gan_data())
    if base == "gan_weight_clip":
        module = WeightClippedGAN()
        result = run.fit(module, run.trainer(max_epochs=2), data=gan_data())
        if run.devices == 1:
            result["ref_only"]["clipped_values"] = module.clipped_values
        return result
    if base == "try_except_forward":
        return run.fit(TryExcept(), run.trainer(max_epochs=1))
    manual = {
        "manual_two_backward": ManualTwoBackward,
        "manual_retain_graph": ManualRetainGraph,
        "manual_subset_step": ManualSubsetStep,
        "manual_accumulate": ManualAccumulate,
        "manual_clip": ManualClip,
    }
    if base in manual:
        module = manual[base]()
        result = run.fit(module, run.trainer(max_epochs=2))
        if base == "manual_clip" and run.devices == 1:
            result["ref_only"]["norms"] = module.norms
        return result
    if base in ORDER_MODULES:
        if base == "eval_reverse":
            trainer = run.trainer(options=options, max_epochs=2, val_check_interval=2, limit_val_batches=2)
            return run.fit(EvalReverse(), trainer, val=True)
        return run.fit(ORDER_MODULES[base](), run.trainer(options=options, max_epochs=2))
    if base == "lora":
        return run.fit(LoRA(), run.trainer(max_epochs=2, wrap={LoRABlock}))
    if base == "flip_requires_grad":
        return run.fit(FlipRequiresGrad(), run.trainer(max_epochs=3))
    if base == "frozen_from_start":
        return run.fit(FrozenFromStart(), run.trainer(max_epochs=2))
    if base == "second_trainer":
        module = Validated()
        trainer = run.trainer(max_epochs=1)
        loader = run.loader(trainer)
        trainer.fit(module, loader)
        after_first = gather_state(trainer, module)
        trainer2 = run.trainer(max_epochs=1, limit_val_batches=2)
        loader2 = run.loader(trainer2)
        trainer2.validate(module, loader2, verbose=False)
        trainer2.fit(module, loader2)
        result = run.result(trainer2, module)
        if run.rank == 0:
            result["snapshots"] = {"after_first_fit": after_first}
        return result
    if base == "calls_from_callbacks":
        trainer = run.trainer(max_epochs=2, limit_val_batches=2, callbacks=[CallsEverywhere()])
        return run.fit(Validated(), trainer, val=True)
    if base == "calls_between_accumulation":
        trainer = run.trainer(max_epochs=2, accumulate_grad_batches=2, callbacks=[CallsBetweenAccumulation()])
        return run.fit(Base(), trainer)
    if base == "calls_between_held_accumulation":  # the first micro-batch's gradients are held, not reduced
        options = {"sync_gradients_while_accumulating": False}
        trainer = run.trainer(
            options=options, max_epochs=2, accumulate_grad_batches=2, callbacks=[CallsBetweenAccumulation()]
        )
        return run.fit(Base(), trainer)
    if base == "rank0_in_full_weights":
        return run.fit(Base(), run.trainer(max_epochs=2, callbacks=[Rank0InFullWeights()]))
    if base == "hf_generate":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        trainer = run.trainer(max_epochs=2, wrap={LlamaDecoderLayer}, callbacks=[GenerateAtEpochEnd()])
        return run.fit(HFLlama(), trainer)
    if base == "hf_activation_checkpointing":  # the one-device reference runs without checkpointing
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        options = {"activation_checkpointing_policy": {LlamaDecoderLayer}}
        trainer = run.trainer(options=options, max_epochs=2, wrap={LlamaDecoderLayer}, callbacks=[GenerateAtEpochEnd()])
        module = HFLlamaCountingLayerCalls()
        result = run.fit(module, trainer)
        result["training_mlp_calls"] = module.training_mlp_calls
        return result
    if base == "rank0_inference":
        module = Base()
        trainer = run.trainer(max_epochs=1)
        trainer.fit(module, run.loader(trainer))
        state = gather_state(trainer, module)
        result = run.result(trainer, module, state)
        if trainer.is_global_zero:
            # Plain PyTorch on rank 0 alone, after fit, as a user's script does next.
            x = samples(SAMPLES).tensors[0]
            faulthandler.dump_traceback_later(INFERENCE_WATCHDOG_S, exit=True)
            module.eval()
            with torch.no_grad():
                result["values"] = {"inference": module(x)}
        return result
    raise ValueError(f"unknown pattern {name!r}")


def save(results: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    torch.save(results, tmp)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = [n for n in args.patterns.split(",") if n]
    if args.devices == 1:  # the prefetch options only matter to the sharded run
        names = list(dict.fromkeys(n.partition("@")[0] for n in names))
    run = Runner(args.devices)
    results: dict = {}
    for name in names:
        if run.rank == 0:
            with open(f"{args.out}.progress", "a") as f:
                f.write(f"{name}\n")
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        started = time.monotonic()
        run.last_trainer = None
        try:
            results[name] = run_pattern(name, run)
        except Exception as exc:  # noqa: BLE001 - recorded for the test; the next pattern runs
            trainer_steps = run.last_trainer.global_step if run.last_trainer is not None else None
            results[name] = {
                "error": {
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": traceback.format_exc()[-6000:],
                    "steps": trainer_steps,
                }
            }
        faulthandler.cancel_dump_traceback_later()
        results[name]["seconds"] = time.monotonic() - started
        print(
            f"[rank {run.rank}] {name}: {'error' if 'error' in results[name] else 'ok'} "
            f"({results[name]['seconds']:.1f} s)",
            flush=True,
        )
        save(results, f"{args.out}.rank{run.rank}")
    faulthandler.dump_traceback_later(30, exit=True)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
