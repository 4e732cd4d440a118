"""The training config: every key a run reads, its default and its documentation, and the
variants experiment files apply.

Experiment files in configs/ start from `base_config()` and change values; the returned
ConfigDict is locked, so a misspelt key (in a config file or a --config.x=y override) fails at
start-up instead of silently doing nothing. Its values are checked, each with one clear line,
where they are read: `settings.Settings.from_config`.
"""

from __future__ import annotations

import ast
import inspect
import re
import tokenize
from typing import Any, Callable, Iterator, Mapping

import ml_collections

DTYPES = ("float32", "bfloat16", "float16")
CACHE_DTYPES = ("", "bfloat16", "float32")  # "": the model's matmul dtype.
EXPORT_FORMATS = ("merged", "peft")
# eval.cache_dir's default: the user's cache, shared by every run on the machine.
EVALUATION_CACHE_DIR = "~/.cache/agentgym_jax/evaluations"
Variant = Callable[[ml_collections.ConfigDict], None]  # Edits a config in place.


def base_config() -> ml_collections.ConfigDict:
  """Defaults: the paper's GRPO recipe (AgentGym-RL scripts, Qwen2.5-7B-Instruct)."""
  c = ml_collections.ConfigDict()
  c.mode = "rl"  # rl | sft | dpo
  c.seed = 0  # Every random draw derives from (seed, step): a rerun repeats the run.
  c.steps = 300  # RL (or SFT / DPO) steps of the run.

  # The policy: which checkpoint, its numerics and its memory plan.
  c.model = ml_collections.ConfigDict()
  c.model.name = "qwen2.5-7b-instruct"  # A registry name or a Hugging Face checkpoint dir.
  # Matmul inputs; auto: bf16 where the hardware runs it fast (agentgym_jax/hardware.py).
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"  # Parameters and optimizer state.
  # What the backward pass recomputes: none | dots | full, or auto: the fastest whose update step
  # fits in the device's memory (agentgym_jax/memory.py's estimate, compiled at start-up).
  c.model.remat = "auto"
  # The learner's attention: auto (splash kernel on TPU, flash elsewhere) | flash | splash | dense.
  c.model.attention = "auto"
  # on | off: off pre-fills an empty think block in every generation prompt, as Qwen3's
  # template does with enable_thinking=False (the template must have that switch).
  c.model.thinking = "on"
  # LoRA (agentgym_jax/models/lora.py): rank 0 trains every weight; rank r > 0 trains adapters
  # delta W = (alpha / r) A B on the `targets` projections only, the base frozen.
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0  # Adapter rank; 0: full fine-tuning.
  c.model.lora.alpha = 16.0  # Scale alpha / rank of the adapters' product.
  # The projections that get adapters.
  c.model.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")
  c.model.lora.dropout = 0.0  # Of the adapters' input, in the update's forward only.

  # The device mesh (data, fsdp, tensor): its sizes multiply to the device count.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # Replicas, each with a whole copy of the parameters.
  c.mesh.fsdp = -1  # -1: all remaining devices.
  c.mesh.tensor = 1  # Tensor (model) parallelism within a layer.
  # A split mesh: the sampler on the last rollout_devices devices, a (1, n / rollout_tensor,
  # rollout_tensor) mesh of its own, the learner's mesh on the others; the weights are copied
  # device to device after each update. 0: the sampler shares the learner's mesh.
  c.mesh.rollout_devices = 0
  c.mesh.rollout_tensor = 1

  c.env = ml_collections.ConfigDict()  # The environment the policy plays.
  c.env.name = "textcraft"  # A registered adapter (environments.registered()).
  c.env.options = ml_collections.ConfigDict()  # Keyword arguments of the adapter.
  c.env.backend = "thread"  # thread | process
  c.env.step_timeout = 120.0  # Seconds; a slower env step ends that episode.
  c.env.failed_episodes = "exclude"  # exclude | zero_reward: env faults in the loss.
  # react (the paper's "Thought: ... Action: ...") | tool_call (the env's actions as tools the
  # model calls, shown as its chat template shows tools; environments/base.py).
  c.env.action_format = "react"
  # A drawn time every env step sleeps first (environments/latency.py), standing in for a slow
  # simulator, browser or remote env in benchmarks: log-normal, capped.
  c.env.latency = ml_collections.ConfigDict()
  c.env.latency.mean_s = 0.0  # Mean seconds a step; 0: none.
  c.env.latency.sigma = 0.9  # Log-space spread (0.9: the 99.9th percentile near 10 x mean).
  c.env.latency.max_s = 3.0  # The cap.
  # A mixture of environments (environments/mixture.py; env.name "mixture", env.options empty):
  # a tuple of dicts {"name": a registered adapter, "weight": > 0, "options": its keyword
  # arguments, "horizon": its own turn cap below the step's, "label": its name in metrics and
  # categories (default: name; two components of one environment need distinct labels)}, the
  # last three optional. Each task of a step picks a component in proportion to the weights,
  # then that component's next train task. (): env.name alone.
  c.env.mixture = ()

  # Model-judged rewards (agentgym_jax/judge.py): a model scores the step's episodes.
  c.reward = ml_collections.ConfigDict()
  c.reward.judge = ml_collections.ConfigDict()
  # "" (off) | reference (the answers environments ask to be judged: WebArena's fuzzy_match,
  # SearchQA's with judge_answers) | rubric (each episode against `rubric`, 0..10) | group
  # (a group's episodes ranked together against `rubric`, min-max normalised, as RULER).
  c.reward.judge.mode = ""
  # The judge: a model this project's sampler runs (registry name, HF directory or Hub id), or
  # the base URL of an OpenAI-compatible server (e.g. http://host:8000/v1); exactly one.
  c.reward.judge.model = ""
  c.reward.judge.base_url = ""
  c.reward.judge.served_model = ""  # The model named in requests to base_url.
  c.reward.judge.api_key_env = "OPENAI_API_KEY"  # Its bearer key, read from this variable.
  c.reward.judge.rubric = ""  # What a good episode is (rubric and group modes).
  c.reward.judge.max_new_tokens = 256  # Per judge reply.
  c.reward.judge.max_context = 8192  # Tokens of a prompt and its reply (model only).
  c.reward.judge.rows = 16  # Prompts a decode batch (model), or requests in flight (base_url).
  c.reward.judge.timeout_s = 120.0  # Per request to base_url.
  c.reward.judge.episode_chars = 12000  # Of an episode's text shown to the judge.

  c.rollout = ml_collections.ConfigDict()  # How a step plays its episodes.
  c.rollout.tasks_per_step = 32  # Tasks (groups) a step plays.
  c.rollout.samples_per_task = 8  # Episodes per task: the group size.
  c.rollout.max_new_tokens = 512  # Per assistant turn.
  c.rollout.max_context = 16384  # Tokens per trajectory (KV-cache slots).
  c.rollout.temperature = 1.0  # Sampling temperature of the rollout.
  c.rollout.top_p = 1.0  # Nucleus sampling; 1.0: off.
  c.rollout.top_k = 0  # 0: off.
  c.rollout.max_logprob_gap = 1.0  # The sampler/learner log-prob gap that stops the run.
  # Row groups whose env steps overlap the other groups' decoding (1: no pipelining).
  c.rollout.pipeline_groups = 1
  # Rows a process plays at once: its rows of a step in consecutive waves of this many (0: all
  # at once). The KV cache and the env pool hold one wave; the paper's 256 rows x 10k tokens
  # are more cache than a v5e-16 holds beside the training state (docs/scaling.md).
  c.rollout.wave_rows = 0
  # Continuous batching: a row whose episode ends takes the next one at once (the same tokens
  # per episode) instead of waiting for its wave (wave_rows below a process's rows) or its
  # evaluation batch to end.
  c.rollout.refill = True
  # Tokens of a reply a decode call samples at most (0: the whole reply, max_new_tokens). With
  # chunks a row whose reply ends steps its env while the other rows keep decoding, and rejoins
  # when the step is back: rows never wait for the longest reply of a call. The same tokens.
  c.rollout.decode_chunk = 0
  # Asynchronous RL: step s is played by the policy of max(0, s - max_staleness) updates, ahead
  # of the learner (rollout_queue.py); the correction (algorithm.rollout_correction) must not
  # be none: auto picks decoupled PPO's.
  c.rollout.max_staleness = 0
  # Partial rollouts (max_staleness > 0): after every this many rounds of replies (decode
  # calls that start replies) of a step's rollout, its live episodes move to the next newer
  # policy, up to the step's own, re-prefilled under it (rollout.PolicySwitches); each token's
  # sampler log-prob is the newer policy's, so the correction weighs it. 0: off, a step is
  # played by one policy.
  c.rollout.partial_rollouts = 0
  c.rollout.cache_dtype = ""  # KV cache: "" (model.dtype) | bfloat16 | float32
  # What a row's context holds of its episode: full (every turn) | window (the first user turn
  # and the last context_turns turns) | mask_observations (every reply; observations older than
  # the last context_turns turns replaced by a placeholder). A rewrite re-prefills the row every
  # context_turns turns from 2 x context_turns on, and when the next turn would not fit.
  c.rollout.context = "full"
  c.rollout.context_turns = 4
  # A curriculum: per horizon stage, the task categories (env task_info "category", e.g.
  # TextCraft's "depth1") its training tasks are drawn from; a stage past the last entry keeps
  # the last one. (): every train task at every stage.
  c.rollout.curriculum = ()
  # DAPO's dynamic sampling: drop the groups whose rewards are all equal (no signal for a group
  # baseline) and play more tasks until the step has tasks_per_step groups with signal, up to
  # max_sampling_rounds rounds of tasks_per_step tasks (then train on what there is).
  c.rollout.dynamic_sampling = False
  c.rollout.max_sampling_rounds = 3  # Rounds of dynamic sampling per step at most.
  # How a step draws its training tasks from its horizon stage's (trainer.py): permutation (a
  # new random permutation of them every epoch) | learnability (in proportion to p (1 - p) +
  # task_sampling_floor, p a moving average of the policy's success on the task, of weight
  # task_sampling_rate per visit and 1/2 before the first: the tasks it sometimes solves, whose
  # groups' rewards differ, come first; the floor keeps those it always or never solves in play).
  c.rollout.task_sampling = "permutation"
  c.rollout.task_sampling_floor = 0.01  # Learnability: weight every task keeps.
  c.rollout.task_sampling_rate = 0.5  # Learnability: moving-average weight of a visit.

  # ScalingInter-RL: the turn cap as a function of the step.
  c.horizon = ml_collections.ConfigDict()
  c.horizon.kind = "stepwise"  # fixed | stepwise | linear (ScalingInter-RL)
  c.horizon.caps = (10, 20, 30)  # stepwise: the caps in order.
  c.horizon.every = 100  # stepwise: steps per cap.
  c.horizon.turns = 30  # fixed
  c.horizon.initial = 10  # linear
  c.horizon.increment = 5  # linear
  c.horizon.maximum = 30  # linear

  c.algorithm = ml_collections.ConfigDict()  # Advantages, the policy loss and the updates.
  c.algorithm.advantage = "grpo"  # grpo | rloo | reinforce_plus_plus | gae | gigpo
  c.algorithm.grpo_normalize_by_std = True  # GRPO: divide by the group's std (False: Dr. GRPO).
  # population (ours) | unbiased (torch.std, as verl, TRL and AgentGym-RL): the latter's
  # advantages are ours times sqrt((n - 1) / n) for a group of n.
  c.algorithm.grpo_std = "population"
  c.algorithm.grpo_eps = 1e-6  # A = (r - mean) / (std + eps).
  # GiGPO's omega: A = A_episode + omega * A_step, the step level over turns from the same state.
  c.algorithm.gigpo_step_weight = 1.0
  c.algorithm.gamma = 1.0  # Discount (GAE, REINFORCE++).
  c.algorithm.lam = 1.0  # GAE's lambda.
  # outcome (the episode's reward on its last generated token) | turn (each turn's reward on the
  # last token of that turn: REINFORCE++ and GAE credit it where it was earned). GRPO and RLOO
  # score the outcome, GiGPO both (rl/advantages.py).
  c.algorithm.reward_placement = "outcome"
  # An episode cut by the turn cap, the context limit or a step timeout: fail (its rewards as
  # earned, 0 for the unfinished task) | mask (left out of the loss and of its group's baseline).
  c.algorithm.truncated_episodes = "fail"
  # DAPO's soft overlong penalty of a reply within `length` tokens of rollout.max_new_tokens:
  # up to -penalty_factor, added to its turn's reward (rollout.OverlongBuffer).
  c.algorithm.overlong_buffer = ml_collections.ConfigDict()
  c.algorithm.overlong_buffer.length = 0  # 0: off.
  c.algorithm.overlong_buffer.penalty_factor = 1.0
  # Negative advantages are scaled by this weight (rl.weight_negatives): < 1 bounds the push-down
  # of failed episodes against the pull-up of successful ones; 0 trains on successes only.
  c.algorithm.negative_advantage_weight = 1.0
  c.algorithm.policy_loss = "ppo"  # ppo | gspo | cispo | clip_cov | kl_cov
  c.algorithm.clip_eps_low = 0.2  # PPO's clip range of the token ratio.
  c.algorithm.clip_eps_high = 0.2  # Above clip_eps_low: clip-higher (DAPO).
  c.algorithm.dual_clip_c = 0.0  # 0: off; else c > 1 (PPO only).
  # GSPO's clip range of the length-normalised sequence ratio (the paper's values).
  c.algorithm.gspo_clip_eps_low = 3e-4
  c.algorithm.gspo_clip_eps_high = 4e-4  # GSPO's upper clip.
  # CISPO's clip of the stop-gradient importance weight: [1 - low, 1 + high]; low = 1 leaves
  # it without a lower bound, as MiniMax-M1.
  c.algorithm.cispo_clip_eps_low = 1.0
  c.algorithm.cispo_clip_eps_high = 5.0  # CISPO's upper clip.
  # Clip-Cov (Cui et al. 2025, verl's names and defaults): PPO's clipped loss, with the gradient
  # of clip_cov_ratio of the trained tokens, drawn among those whose advantage-log-prob
  # covariance is in (clip_cov_lb, clip_cov_ub), detached.
  c.algorithm.clip_cov_ratio = 2e-4
  c.algorithm.clip_cov_lb = 1.0
  c.algorithm.clip_cov_ub = 5.0
  # KL-Cov: the unclipped loss, plus ppo_kl_coef |log ratio| on the kl_cov_ratio of the trained
  # tokens of largest covariance.
  c.algorithm.kl_cov_ratio = 2e-4
  c.algorithm.ppo_kl_coef = 1.0
  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
  c.algorithm.aggregation = "token-mean"
  # seq-mean-token-sum-norm's constant divisor (Dr. GRPO); 0: rollout.max_new_tokens times the
  # horizon's largest cap, the most tokens a trajectory can have trained.
  c.algorithm.loss_scale_tokens = 0
  # Sampler-learner mismatch (rl/correction.py): none | decoupled | token_tis | sequence_mask |
  # geometric_mask | auto (decoupled when rollout.max_staleness > 0, else none).
  c.algorithm.rollout_correction = "auto"
  c.algorithm.rollout_correction_cap = 2.0  # The correction's cap on the ratio.
  c.algorithm.kl_coef = 1e-3  # KL to the reference as a loss.
  c.algorithm.kl_estimator = "low_var_kl"  # k1 | k2 | k3 | low_var_kl | kl | mse | abs
  c.algorithm.kl_in_reward_coef = 0.0  # KL to the reference as a reward penalty.
  # The penalty's per-token estimate: k1, an estimate of the KL's gradient direction as a
  # reward (REINFORCE++ eq. 9, verl); k3 estimates the KL's value, the loss term's job.
  c.algorithm.kl_in_reward_estimator = "k1"
  c.algorithm.entropy_coef = 1e-3  # Entropy bonus.
  c.algorithm.value_coef = 0.5  # Value loss weight (gae).
  c.algorithm.value_clip_eps = 0.2  # Value clip range (gae).
  c.algorithm.ppo_epochs = 1  # Passes over a step's batch.
  c.algorithm.num_minibatches = 4  # Optimizer steps per epoch.
  # A step without learning signal (every trained token's advantage exactly 0, and no KL,
  # entropy or value term in the loss) skips its optimizer updates, and its experience pass too
  # when the rewards already show it (trainer.py). Its gradient is 0, yet updating on it still
  # moves the weights (AdamW's momentum and weight decay) and advances the learning-rate
  # schedule, as verl and AgentGym-RL do: off by default, like the rest of their recipe.
  c.algorithm.skip_no_signal_updates = False
  # Rows per forward/backward pass in the experience pass and the update, the gradient of a
  # minibatch accumulated over its micro-batches (learner.py); 0: a minibatch at once.
  c.algorithm.micro_batch_rows = 0
  # The learner's forward passes pack each task's samples as one row, their common prompt once
  # and then every continuation (agentgym_jax/batch.py); minibatches and micro-batches then
  # hold whole tasks. Log-probs, losses and gradients are those of the unshared rows, but
  # minibatches of whole tasks instead of random rows change the updates' course: off until
  # that is shown not to slow learning (docs/training.md, "Memory and compute", says what was
  # measured).
  c.algorithm.shared_prompts = False
  c.algorithm.logprob_chunk = 512  # Tokens per block of the chunked log-probs.

  c.optim = ml_collections.ConfigDict()  # AdamW and its schedule.
  c.optim.learning_rate = 1e-6  # Peak learning rate.
  c.optim.schedule = "constant"  # constant | cosine
  c.optim.warmup_steps = 0  # Optimizer steps of linear warmup from 0.
  c.optim.weight_decay = 0.01  # AdamW's decoupled decay.
  c.optim.b1 = 0.9  # Adam's first-moment decay.
  c.optim.b2 = 0.999  # Adam's second-moment decay.
  c.optim.eps = 1e-8  # Adam's denominator floor: update = lr m / (sqrt(v) + eps)
  c.optim.grad_clip = 1.0  # The global gradient norm's clip (> 0).
  c.optim.max_consecutive_nonfinite = 5  # Skipped non-finite updates in a row that stop the run.
  # RL: between updates the optimizer state waits in the host memory of its devices (pinned),
  # which leaves their memory to the rollout's sampler copy and KV cache (docs/scaling.md).
  c.optim.offload_state = False

  # Orbax checkpoints in workdir/checkpoints and the final export.
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 10  # Steps between checkpoints; 0: only the last.
  c.checkpoint.keep = 3  # Newest checkpoints kept.
  c.checkpoint.export_hf = True  # Write the final policy as a Hugging Face directory.
  # f32 by default: a bf16 copy of a small model can degenerate under greedy decoding
  # (SmolLM2-135M repeats itself in transformers where the same weights in f32 answer).
  c.checkpoint.export_dtype = "float32"
  # merged: a Hugging Face directory of the policy (with LoRA, W + delta W) | peft: LoRA's
  # adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors).
  c.checkpoint.export_format = "merged"

  c.log = ml_collections.ConfigDict()  # What a run writes beside its metrics.jsonl.
  c.log.tensorboard = True  # TensorBoard events in workdir/tensorboard.
  c.log.trajectories = True  # Every episode in workdir/trajectories.
  c.log.progress_bar = True  # A progress bar on a terminal.
  # Weights & Biases (the `wandb` extra): config and metrics, the viewer page at the end.
  c.log.wandb = False
  c.log.wandb_project = "agentgym-jax"  # The wandb project.
  c.log.wandb_run_name = ""  # "" names the run after its workdir.

  c.eval = ml_collections.ConfigDict()  # Held-out evaluations: during training and of each stage.
  c.eval.every = 0  # Steps between evaluations on eval.split; 0: off.
  c.eval.split = "test"  # train | test
  c.eval.samples_per_task = 1  # k of avg@k and pass@k.
  c.eval.max_tasks = 0  # Tasks of the split (of each environment of a mixture); 0: all.
  c.eval.temperature = 0.0  # 0: greedy.
  # Evaluate each stage of the recipe (recipe.py): the initial policy, the warm-started one
  # and the trained one, into workdir/evaluation, ending with a table of the three.
  c.eval.stages = False
  c.eval.rows = 0  # Episodes played at once by a stage evaluation; 0: an RL step's rows.
  c.eval.horizon = 0  # Turn cap; 0: the horizon schedule's largest cap.
  # Where stage evaluations are kept by fingerprint (the model's files and the settings that
  # decide the outcome), so a policy is not played again on the same evaluation, in any
  # workdir (recipe.py); "": off.
  c.eval.cache_dir = EVALUATION_CACHE_DIR

  # Offline paradigms (mode sft or dpo): conversations instead of rollouts.
  c.data = ml_collections.ConfigDict()
  c.data.path = ""  # JSONL of conversations (launch/make_demos.py) or a run's workdir.
  c.data.batch_size = 8  # Conversations (SFT) or pairs (DPO) per step.
  c.data.max_length = 4096  # Tokens per conversation at most.
  c.data.min_reward = 1.0  # Rollouts kept as SFT data / DPO needs a reward gap.
  c.dpo = ml_collections.ConfigDict()  # Direct preference optimisation (mode dpo).
  c.dpo.beta = 0.1  # DPO's inverse temperature.

  # An RL run's SFT warm start on verified expert demonstrations (agentgym_jax/recipe.py).
  c.warm_start = ml_collections.ConfigDict()
  c.warm_start.steps = 0  # SFT steps before RL; 0: off (the paper's recipe).
  c.warm_start.demonstrations = ""  # A JSONL of conversations; "": made with the env's expert.
  c.warm_start.max_tasks = 0  # Train tasks the expert demonstrates; 0: all.
  c.warm_start.learning_rate = 1e-4  # The SFT's learning rate.
  c.warm_start.batch_size = 4  # Demonstrations per SFT step.
  c.lock()
  c.env.options.unlock()  # Adapter keyword arguments differ per environment.
  return c


class ConfigError(ValueError):
  """A config value that cannot run, reported as one line naming the key."""


def key_comments() -> Iterator[tuple[str, str]]:
  """(key, its comments as one line) of every assignment in `base_config`, in source order: the
  comment lines just above the assignment and the one at its end. They are the keys'
  documentation, read by --help (a group's comment) and docs/config_reference.py (all)."""
  source = inspect.getsource(base_config)
  lines = source.splitlines(keepends=True)
  comments = {
      token.start[0]: token.string.lstrip("#").strip()
      for token in tokenize.generate_tokens(iter(lines).__next__) if token.type == tokenize.COMMENT
  }
  for node in ast.parse(source).body[0].body:
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
      continue
    parts, target = [], node.targets[0]
    while isinstance(target, ast.Attribute):  # c.a.b -> "a.b"
      parts.insert(0, target.attr)
      target = target.value
    if not (parts and isinstance(target, ast.Name)):
      continue
    above, line = [], node.lineno - 1
    while line >= 1 and lines[line - 1].strip().startswith("#"):
      above.insert(0, comments[line])
      line -= 1
    trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
    yield ".".join(parts), re.sub(r"\s+", " ", " ".join(above + trailing))


def local(c: ml_collections.ConfigDict) -> None:
  """The embedded SmolLM2-135M-Instruct on a CPU workstation: small batches, short replies."""
  c.steps = 20
  c.model.name = "smollm2-135m-instruct"
  # bf16 matmuls on a CPU with AMX or AVX512-BF16, f32 on one without (there bf16 runs 1.5-3x
  # slower than f32; benchmarks/train_step.py prints both peaks).
  c.model.dtype = "auto"
  c.rollout.tasks_per_step = 4
  c.rollout.samples_per_task = 4
  # An overlong buffer keeps its share of the shorter replies.
  buffer = c.algorithm.overlong_buffer
  buffer.length = buffer.length * 64 // c.rollout.max_new_tokens
  c.rollout.max_new_tokens = 64
  c.rollout.max_context = 2048
  # Horizons scaled so that the longest cap is 8 turns: TextCraft's [10, 20, 30] -> [3, 5, 8].
  scale = 8 / max(c.horizon.caps)
  c.horizon.caps = tuple(max(1, round(cap * scale)) for cap in c.horizon.caps)
  c.horizon.turns = max(1, round(c.horizon.turns * scale))
  c.horizon.every = 8
  c.algorithm.num_minibatches = 2
  c.optim.learning_rate = 1e-5
  c.checkpoint.every = 5


def quiet(c: ml_collections.ConfigDict) -> None:
  """A run that writes only metrics.jsonl: no checkpoints, export, TensorBoard, trajectory
  logs or progress bar (tests, benchmarks, small ablations)."""
  c.checkpoint.every = 0
  c.checkpoint.export_hf = False
  c.log.tensorboard = False
  c.log.trajectories = False
  c.log.progress_bar = False


def tiny_echo(c: ml_collections.ConfigDict) -> None:
  """A small policy (tests/tiny.py's random model) on the echo task, on one device in f32:
  8 tasks x 8 samples of 2-token replies, plain GRPO with a step large enough to learn echo in
  tens of steps (with 2e-3 it did not within 30), quiet."""
  c.model.dtype = "float32"
  c.model.remat = "none"
  c.mesh.data = 1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.env.name = "echo"
  c.rollout.tasks_per_step = 8
  c.rollout.samples_per_task = 8
  c.rollout.max_new_tokens = 2  # A symbol and the end-of-turn token.
  c.algorithm.kl_coef = 0.0
  c.algorithm.entropy_coef = 0.0
  c.algorithm.num_minibatches = 2
  c.algorithm.ppo_epochs = 2
  c.algorithm.logprob_chunk = 64
  c.optim.learning_rate = 3e-3
  c.optim.weight_decay = 0.0
  quiet(c)


def fixed_horizon(turns: int) -> Variant:
  """A variant that replaces the staged schedule by a fixed cap (the paper's baselines)."""

  def apply(c: ml_collections.ConfigDict) -> None:
    c.horizon.kind = "fixed"
    c.horizon.turns = turns

  return apply


def standard_variants(short: int = 10, long: int = 30) -> dict[str, Variant]:
  """The variants every RL config offers: `local` (the embedded SmolLM2 on a CPU) and `short` /
  `long`, fixed caps of `short` / `long` turns (the paper's baselines)."""
  return {"local": local, "short": fixed_horizon(short), "long": fixed_horizon(long)}


def apply_variants(c: ml_collections.ConfigDict, variant: str,
                   variants: Mapping[str, Variant]) -> ml_collections.ConfigDict:
  """Applies comma-separated variants in order, e.g. `configs/x.py:short,local`."""
  for name in filter(None, (v.strip() for v in variant.split(","))):
    if name not in variants:
      raise ConfigError(f"unknown config variant {name!r}; expected some of {sorted(variants)}")
    variants[name](c)
  return c


def set_key(c: ml_collections.ConfigDict, key: str, value: Any) -> None:
  """Sets the dotted `key` (e.g. "model.lora.rank") of `c`; a key `base_config` lacks is refused,
  except in its open sections (env.options: the adapter's own keyword arguments)."""
  *sections, name = key.split(".")
  node = c
  for section in sections:
    if not isinstance(node.get(section), ml_collections.ConfigDict):
      raise ConfigError(f"unknown config key {key!r}: no section {section!r}")
    node = node[section]
  if name not in node and node.is_locked:
    raise ConfigError(f"unknown config key {key!r}")
  node[name] = value


def experiment(env: str, settings: Mapping[str, Any] | None = None, *,
               variants: Mapping[str, Variant] | None = None, short: int = 10,
               long: int = 30) -> Callable[[str], ml_collections.ConfigDict]:
  """The `get_config(variant)` of an RL experiment file: `base_config` on the environment `env`
  with `settings` (dotted keys, e.g. {"algorithm.advantage": "gae"}), then the variants asked
  for, chosen from the standard ones (`local`, fixed `short` / `long` turn caps) and `variants`.

    get_config = config.experiment("textcraft", {"algorithm.advantage": "rloo"})
  """

  def get_config(variant: str = "") -> ml_collections.ConfigDict:
    c = base_config()
    c.env.name = env
    for key, value in (settings or {}).items():
      set_key(c, key, value)
    return apply_variants(c, variant, {**standard_variants(short, long), **(variants or {})})

  return get_config
