#!/usr/bin/env bash
# PPO (GAE) against GRPO, RLOO and REINFORCE++ on a task preset at the same responses per iteration:
# 3 seeds x 4 estimators, one run at a time, each with its peak RSS (/usr/bin/time -v); finished
# runs are skipped, so the script resumes where it stopped. Each run's report.json has the
# held-out figures (eval_before/eval_after), final_kl and seconds_per_iteration; <run>.time the RSS.
#   [TASK=arithmetic] [OUT=outputs/estimators] [SEEDS="0 1 2"] bash benchmarks/estimators.sh   (environment variables)
# then the table: rlhf-torchrl bench estimators_table --task arithmetic --runs outputs/estimators
set -uo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-arithmetic} OUT=${OUT:-outputs/estimators} SEEDS=${SEEDS:-"0 1 2"}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
for seed in $SEEDS; do
  for est in rloo gae grpo reinforce_pp; do
    case $est in
      gae) extra=();;                                    # the preset: 32 prompts x 1 response
      reinforce_pp) extra=(advantage.estimator=reinforce_pp);;
      *) extra=(advantage.estimator=$est generation.samples_per_prompt=4);;  # 8 prompts x 4
    esac
    run="$OUT/${TASK}_${est}_$seed"
    [ -f "$run/report.json" ] && continue
    /usr/bin/time -v python recipes/ppo.py task="$TASK" seed="$seed" "${extra[@]}" \
      output_dir="$run" hydra.run.dir="$run" logging.progress_bar=false resume=never \
      > "$run.log" 2> "$run.time" || echo "failed: $run (see $run.log)"
  done
done
