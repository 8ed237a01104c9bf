#!/usr/bin/env bash
# PPO (GAE) against GRPO, RLOO and REINFORCE++ on a task preset at the same responses per iteration:
# 3 seeds x 4 estimators, one run at a time, each with its peak RSS (/usr/bin/time -v); finished
# runs are skipped, so the script resumes where it stopped. Each run's report.json has the
# held-out figures (eval_before/eval_after), final_kl and seconds_per_iteration; <run>.time the RSS.
#   [TASK=arithmetic] [OUT=outputs/estimators] [SEEDS="0 1 2"] bash benchmarks/estimators.sh   (environment variables)
# then the table: rlhf-torchrl bench estimators_table --task arithmetic --runs outputs/estimators
# A variant of the same runs: EXTRA (overrides added to every run) and TAG (in the run names),
#   ESTIMATORS=gae EXTRA="model.autocast=bfloat16" TAG=bf16 bash benchmarks/estimators.sh
#   rlhf-torchrl bench estimators_table --task arithmetic --tag bf16
set -uo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-arithmetic} OUT=${OUT:-outputs/estimators} SEEDS=${SEEDS:-"0 1 2"}
ESTIMATORS=${ESTIMATORS:-"rloo gae grpo reinforce_pp"} TAG=${TAG:-}
read -ra EXTRA <<< "${EXTRA:-}"
if [ ${#EXTRA[@]} -gt 0 ] && [ -z "$TAG" ]; then
  echo "EXTRA needs a TAG: the variant's runs need names of their own (TAG=bf16 ...)" >&2; exit 1
fi
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
for seed in $SEEDS; do
  for est in $ESTIMATORS; do
    case $est in
      gae) extra=();;                                    # the preset: 32 prompts x 1 response
      reinforce_pp) extra=(advantage.estimator=reinforce_pp);;
      *) extra=(advantage.estimator=$est generation.samples_per_prompt=4);;  # 8 prompts x 4
    esac
    run="$OUT/${TASK}_${est}${TAG:+_$TAG}_$seed"
    [ -f "$run/report.json" ] && continue
    # no checkpoints and no saved policy (3.8 GB a run): the figures are in report.json
    /usr/bin/time -v python recipes/ppo.py task="$TASK" seed="$seed" "${extra[@]}" "${EXTRA[@]}" \
      output_dir="$run" hydra.run.dir="$run" logging.progress_bar=false resume=never \
      checkpoint.every=0 logging.save_model=false \
      > "$run.log" 2> "$run.time" || echo "failed: $run (see $run.log)"
  done
done
