#!/usr/bin/env bash
# The GPU runner: build, GPU tests, compute-sanitizer, benchmarks, in one call on a GPU machine.
# Results and logs go to $OUT (default ./gpu_out); a short summary is printed last.
#   bash tools/gpu/check.sh [STEP ...]      (default: build test test_sm80 sanitize)
# Steps:
#   build        pip install -e . for sm_90a, as a development build (NITROBREW_DEV_KNOBS=1: the tests
#                of the switches only such a build has run too; docs/development.md)
#   test         the CUDA tests (pytest -k cuda and the CUDA-only files; the randomized ones with
#                NITROBREW_RANDOM_CASES=64 cases per family unless set; the soak test)
#   test_sm80    the same with the sm_80 (mma.sync) kernels forced on this GPU
#   sanitize     every family's sanitizer cases (pytest -m sanitize) under compute-sanitizer memcheck
#                and racecheck, with the kernels the GPU picks and with the sm_80 ones forced
#   test_training  the training path's tests alone (gradients in the forward; fused-linear and top-K), auto and
#                sm_80 kernels
#   test_topk_logprobs  the teacher's top-K's CUDA tests alone (tests/topk_logprobs -k cuda)
#   bench, bench_topk, bench_logits, bench_attention   each family's benchmark, CSV in $OUT (LOGITS_ARGS: more
#                arguments of benchmarks/logits.py, e.g. "--dtype bfloat16 float32 --rounds 3 --topk 32
#                --topk-renormalized forward_kl jsd tvd")
#   bench_training  forward + backward of the training path against the cuBLAS floor, the recompute path
#                and the plain composition, methods alternated over ROUNDS (3) rounds, on the Qwen and
#                Llama-3 shapes at TOKENS (4096 8192 16384); LOSS (forward_kl)
#   bench_entropy  what return_entropy=True costs each path (Qwen and Llama-3 shapes, TOKENS 8192), alternated
#                with the same path without it
#   accuracy     the fused-linear losses' errors against float64, both paths (benchmarks/accuracy_fused_linear.py)
#   bench_topk_logprobs  the teacher's top-K (nitrobrew.topk_logprobs) against cuBLAS's one product and naive
#                PyTorch, N 8192 and 32768, Qwen and Llama-3 teachers, K 8-256 (benchmarks/topk_logprobs.py;
#                TOPK_METHODS and TOPK_K narrow it)
#   bench_topk_rows  topk_logprobs' row kernel alone against a read-only floor (tools/experiments/topk_rows_bench.cu:
#                a 512 MiB chunk of the Qwen and Llama-3 teachers), after its host check; then memcheck and racecheck of
#                it on a small odd shape. Needs no build step
#   profile_topk_logprobs  CUDA time per kernel of topk_logprobs (tools/profiling/topk_logprobs_kernel_times.py)
#   profile_logits  ncu's per-instruction (SASS) view of the logits row kernels, one kernel a run: reports and source
#                CSVs in $OUT (PROFILE_CASES="loss:dtype:kernel ..."; summarize with tools/profiling/ncu_source_summary.py)
#   sass         cuobjdump -sass of the .cubin files in SASS_CUBINS (compiled here with nvcc --keep; no disassembler
#                on the development machine), gzipped into $OUT
#   bench_checks  what the range checks of ids and labels cost per call (benchmarks/input_checks.py)
#   bench_model_options  what lm_head biases and logit scales cost the fused-linear loss
#   hf_step      a whole training step on Hugging Face models (benchmarks/hf_step.py; HF_PAIRS="qwen llama",
#                HF_METHODS, HF_TOKENS)
#   bench_vocab_parallel  the vocabulary-parallel loss on every GPU of the machine (benchmarks/vocab_parallel.py)
#   fsdp2_step   an FSDP2 training step on 2 and every GPU of the machine (benchmarks/fsdp2_step.py)
#   fsdp2_hf     nitrobrew.hf on FSDP2 students and teachers on every GPU, Qwen 0.5B <- 1.5B and <- 7B (issue 44)
#   test_hf_distributed  the FSDP2/DDP tests of nitrobrew.hf and nitrobrew.trl and the distill_fsdp2 example (gloo)
#   examples_multi_gpu  the multi-process examples over NCCL: distill_fsdp2.py (qwen2.5 sizes, bf16) on 2 and every
#                GPU, FSDP2 and DDP students; remote_teacher.py --check on GPUs 0 and 1; logs in $OUT
#   test_distributed  the distributed tests' CUDA cases (on one GPU: NCCL over 1 rank, gloo over 2 to 4 sharing it)
#   test_multi_gpu    the distributed tests (NCCL over 2 to 4 GPUs where the machine has them), verbose, with
#                     NCCL's warnings and each rank's stacks printed if it outlasts NITROBREW_RANK_WATCHDOG_S
#   memcheck_multi_gpu  the NCCL cases of the CUDA distributed tests under compute-sanitizer memcheck, every rank
# Several runs at once (tests and sanitizers side by side on one GPU): tools/gpu/parallel.sh.
# TEST_PATHS="tests/fused_linear tests/logits" limits test and test_sm80 to those paths (default: tests).
# FAMILIES="fused_linear logits" limits sanitize to those test folders; SANITIZE_TOOLS="memcheck" and
# SANITIZE_PATHS="default" (or "sm80") to those tools and kernel families; SANITIZE_K to the cases pytest -k picks.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
steps=${*:-build test test_sm80 sanitize}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} NITROBREW_CUDA_ARCHS=${NITROBREW_CUDA_ARCHS:-9.0a}
export NITROBREW_DEV_KNOBS=${NITROBREW_DEV_KNOBS:-1}
# NVLink multicast stays off on the lent multi-GPU hosts (the device library's KINDS.md), for every program.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The randomized tests' cases per family and device (CI's CPU run: 8).
export NITROBREW_RANDOM_CASES=${NITROBREW_RANDOM_CASES:-64}
families=${FAMILIES:-fused_linear topk_linear topk_logprobs logits attention_kl distributed}
status=0
summary=()
# Python packages the GPU machine lacks (liger-kernel for the benchmarks' peer), carried as wheels in
# .whl/ (pip download --no-deps ... -d .whl NAME==VERSION on a machine with a registry; git-ignored, so the device
# call must carry it).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nitrobrew_site .whl/*.whl &&
    export PYTHONPATH=/tmp/nitrobrew_site${PYTHONPATH:+:$PYTHONPATH}
fi
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 15 "$OUT/$name.log"
  summary+=("$name rc=$rc $((SECONDS - t0))s")
  [ $rc -eq 0 ] || status=1
}
sanitize() {  # sanitize TOOL [env ...]: every family's sanitizer cases under compute-sanitizer TOOL
  local tool=$1; shift
  for family in $families; do
    run "${tool}_${family}${SUFFIX:-}" env "$@" compute-sanitizer --tool "$tool" --error-exitcode 1 \
      python3 -m pytest -q -x -m sanitize -p no:cacheprovider ${SANITIZE_K:+-k "$SANITIZE_K"} "tests/$family"
  done
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
for step in $steps; do
  case $step in
    # The system g++ where there is one: on the H100 machine the preset CXX (/opt/gcc/bin/g++, a
    # wrapper around another g++ build) produced an extension whose C++ exceptions segfaulted
    # instead of reaching Python. NITROBREW_BUILD_CXX overrides.
    build) run build env CXX="${NITROBREW_BUILD_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-c++}")}" \
             python3 -m pip install --no-build-isolation --no-deps -v -e . ;;
    test) run test python3 -m pytest ${TEST_PATHS:-tests} -q --maxfail=20 -k "cuda or soak" -p no:cacheprovider ;;
    # The sm_80 (mma.sync) kernels, forced on this GPU (the *_cuda.py files cover both themselves).
    test_sm80) run test_sm80 env NITROBREW_FORCE_SM80=1 python3 -m pytest ${TEST_PATHS:-tests} -q --maxfail=20 \
                 -k "cuda and not fused_linear_cuda" \
                 -p no:cacheprovider ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        for path in ${SANITIZE_PATHS:-default sm80}; do
          if [ "$path" = sm80 ]; then SUFFIX=_sm80 sanitize "$tool" NITROBREW_FORCE_SM80=1; else sanitize "$tool"; fi
        done
      done ;;
    test_training) run test_training python3 -m pytest -q --maxfail=20 -p no:cacheprovider \
                     tests/fused_linear/test_training_path.py tests/fused_linear/test_fused_linear_cuda.py \
                     tests/fused_linear/test_fused_linear_values.py tests/topk_linear/test_topk_linear_training_path.py \
                     -k "cuda or training" ;;
    test_topk_logprobs) run test_topk_logprobs python3 -m pytest tests/topk_logprobs -q -k cuda -p no:cacheprovider ;;
    bench) run bench python3 benchmarks/fused_linear.py --device cuda --repeats 5 --out "$OUT/fused_linear_cuda.csv" ;;
    bench_training)
      shapes=()
      for t in ${TOKENS:-4096 8192 16384}; do shapes+=(--shape "$t,152064,3584,5120" --shape "$t,128256,2048,4096"); done
      run bench_training python3 benchmarks/fused_linear.py --device cuda --loss "${LOSS:-forward_kl}" \
        --rounds "${ROUNDS:-3}" --repeats "${REPEATS:-5}" --modes ${MODES:-fwd_bwd forward} \
        --methods ${METHODS:-cublas_gemms nitrobrew_training nitrobrew_recompute composition} "${shapes[@]}" \
        --out "$OUT/fused_linear_training_cuda.csv" ;;
    # What the student's entropy (return_entropy=True) costs each path, alternated with the same path without it.
    bench_entropy)
      shapes=()
      for t in ${TOKENS:-8192}; do shapes+=(--shape "$t,152064,3584,5120" --shape "$t,128256,2048,4096"); done
      run bench_entropy python3 benchmarks/fused_linear.py --device cuda --loss "${LOSS:-forward_kl}" \
        --rounds "${ROUNDS:-3}" --repeats "${REPEATS:-5}" --modes fwd_bwd forward \
        --methods nitrobrew_training nitrobrew_training_entropy nitrobrew_recompute nitrobrew_recompute_entropy \
        "${shapes[@]}" --out "$OUT/fused_linear_entropy_cuda.csv" ;;
    # The fused-linear losses' errors against float64 on both paths (ACC_TOKENS, 2048; ACC_CHUNK_MIB: the
    # training path's bound, so that dws is rounded once per chunk of it).
    accuracy) for loss in forward_kl reverse_kl jsd; do
                run "accuracy_$loss" python3 benchmarks/accuracy_fused_linear.py --loss "$loss" --tokens "${ACC_TOKENS:-2048}" \
                  ${ACC_CHUNK_MIB:+--grad-chunk-mib "$ACC_CHUNK_MIB"} --out "$OUT/accuracy_fused_linear.csv"
              done ;;
    bench_topk) run bench_topk python3 benchmarks/topk_linear.py --device cuda --out "$OUT/topk_linear_cuda.csv" ;;
    bench_topk_logprobs) run bench_topk_logprobs python3 benchmarks/topk_logprobs.py --device cuda \
                           ${TOPK_METHODS:+--methods $TOPK_METHODS} ${TOPK_K:+--topk $TOPK_K} \
                           --out "$OUT/topk_logprobs_cuda.csv" ;;
    bench_topk_rows)
      run build_topk_rows_bench nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icsrc \
        tools/experiments/topk_rows_bench.cu -o "$OUT/topk_rows_bench"
      run bench_topk_rows sh -c "'$OUT/topk_rows_bench' 882 152064 && '$OUT/topk_rows_bench' 1046 128256"
      for tool in memcheck racecheck; do
        run "${tool}_topk_rows_bench" sh -c "for shape in '3 5003' '2 1001'; do
          compute-sanitizer --tool $tool --error-exitcode 1 '$OUT/topk_rows_bench' \$shape check || exit 1; done"
      done
      rm -f "$OUT/topk_rows_bench" ;;
    profile_topk_logprobs) run profile_topk_logprobs python3 tools/profiling/topk_logprobs_kernel_times.py \
                             --out "$OUT/topk_logprobs_kernel_times.csv" ;;
    profile_logits)  # ncu's per-instruction view of the logits family's row kernels (PROFILE_CASES: loss:dtype:kernel)
      for spec in ${PROFILE_CASES:-jsd:bfloat16:mixture_pass jsd:bfloat16:kl_pass jsd:bfloat16:grad_kernel \
                   skew_reverse_kl:bfloat16:mixture_pass tvd:bfloat16:mixture_pass jsd:float32:mixture_pass}; do
        IFS=: read -r loss dtype kernel <<< "$spec"
        name="ncu_${loss}_${dtype}_${kernel}"
        run "$name" ncu --section SourceCounters --section SpeedOfLight --section WarpStateStats -k "regex:$kernel" -c 1 \
          -f -o "$OUT/$name" python3 tools/profiling/logits_row_kernels.py --loss "$loss" --dtype "$dtype" &&
          ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass 2> /dev/null | gzip > "$OUT/$name.csv.gz"
      done ;;
    sass)  # SASS of the cubins in SASS_CUBINS (a folder carried to the machine; compiled elsewhere with nvcc --keep)
      for f in "${SASS_CUBINS:?SASS_CUBINS names a folder of .cubin files}"/*.cubin; do
        cuobjdump -sass "$f" | gzip > "$OUT/$(basename "$f" .cubin).sass.gz"
      done ;;
    bench_logits) run bench_logits python3 benchmarks/logits.py --device cuda ${LOGITS_ARGS:-} --out "$OUT/logits_cuda.csv" ;;
    bench_checks) run bench_checks python3 benchmarks/input_checks.py --device cuda --out "$OUT/input_checks_cuda.csv" ;;
    bench_model_options) run bench_model_options python3 benchmarks/fused_linear.py --device cuda --rounds 3 \
                           --methods cublas_gemms nitrobrew nitrobrew_bias nitrobrew_scale \
                           --out "$OUT/fused_linear_model_options_cuda.csv" ;;
    hf_step) for pair in ${HF_PAIRS:-qwen llama}; do
               run "hf_step_$pair" python3 benchmarks/hf_step.py --model "$pair" ${HF_METHODS:+--methods $HF_METHODS} \
                 ${HF_TOKENS:+--tokens $HF_TOKENS} --out "$OUT/hf_step_${pair}_cuda.csv"
             done ;;
    bench_vocab_parallel) gpus=$(nvidia-smi -L | wc -l); counts=$(for g in 1 2 4 8; do [ "$g" -le "$gpus" ] && echo "$g"; done)
                          run bench_vocab_parallel python3 benchmarks/vocab_parallel.py --gpus $counts \
                            --out "$OUT/vocab_parallel_${gpus}gpu.csv" ;;
    fsdp2_step) gpus=$(nvidia-smi -L | wc -l)
                run fsdp2_step python3 benchmarks/fsdp2_step.py --gpus $(printf '%s\n' 2 "$gpus" | sort -nu) \
                  --out "$OUT/fsdp2_step_${gpus}gpu.csv" ;;
    # Issue 44: nitrobrew.hf on FSDP2 students and teachers, on every GPU of the machine, both pairs, against the
    # models' own logits; tokens a rank rising until a method runs out of memory (FSDP2_TOKENS).
    fsdp2_hf) gpus=$(nvidia-smi -L | wc -l)
              for pair in qwen qwen7b; do
                run "fsdp2_hf_$pair" python3 benchmarks/fsdp2_step.py --gpus "$gpus" --pair "$pair" --teacher-layout fsdp2 \
                  --methods nitrobrew_hf logits --tokens ${FSDP2_TOKENS:-4096 16384 32768 65536} \
                  --out "$OUT/fsdp2_hf_${pair}_${gpus}gpu.csv"
              done ;;
    test_hf_distributed) run test_hf_distributed python3 -m pytest -q -p no:cacheprovider tests/hf/test_hf_distributed.py \
                           tests/hf/test_trl_distributed.py tests/test_examples.py -k "distributed or fsdp2" ;;
    examples_multi_gpu)
      gpus=$(nvidia-smi -L | wc -l)
      for n in $(printf '%s\n' 2 "$gpus" | sort -nu); do
        for student in fsdp2 ddp; do
          run "distill_fsdp2_${n}gpu_$student" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
            examples/distill_fsdp2.py --sizes qwen2.5 --device cuda --dtype bfloat16 --student "$student" --quiet \
            --out "$OUT/distill_fsdp2_${n}gpu_$student"
        done
      done
      for loss in forward_kl jsd; do
        run "remote_teacher_$loss" python3 examples/remote_teacher.py --device cuda --dtype bfloat16 --full --check \
          --loss "$loss" --quiet --out "$OUT/remote_teacher_$loss"
      done ;;
    test_distributed) run test_distributed python3 -m pytest tests/distributed -q -k cuda -p no:cacheprovider ;;
    test_multi_gpu) run test_multi_gpu env NCCL_DEBUG=WARN NITROBREW_RANK_WATCHDOG_S=${NITROBREW_RANK_WATCHDOG_S:-240} \
                      python3 -m pytest tests/distributed -v -p no:cacheprovider ;;
    # NCCL's communicator setup probes kernels of other GPUs (cudaErrorNoKernelImageForDevice, which it handles):
    # API errors are not reported, memory errors in every rank's kernels are.
    memcheck_multi_gpu) run memcheck_multi_gpu compute-sanitizer --tool memcheck --target-processes all --report-api-errors no \
                          --error-exitcode 1 \
                          python3 -m pytest tests/distributed/test_vocab_parallel_cuda.py -v -k "${MULTI_GPU_K:-nccl}" \
                          -p no:cacheprovider ;;
    bench_attention) run bench_attention python3 benchmarks/attention_kl.py --device cuda --out "$OUT/attention_kl_cuda.csv" ;;
    *) echo "unknown step: $step"; status=1 ;;
  esac
done
echo "== summary"
printf '%s\n' "${summary[@]}"
# The device tool brings back at most 8 files from $OUT: with more, the loose files go into one
# tarball (a run of the default steps writes ~25 logs); tarballs of earlier calls stay as they are.
# NITROBREW_PACK_OUT=0 keeps the files loose.
shopt -s nullglob
loose=() packs=()
for f in "$OUT"/*; do case $f in *.tgz) packs+=("$f") ;; *) loose+=("$f") ;; esac; done
if [ "${NITROBREW_PACK_OUT:-1}" = 1 ] && [ $(( ${#loose[@]} + ${#packs[@]} )) -gt 8 ]; then
  packed="$OUT/check_out_$(date +%H%M%S).tgz"
  tar czf "$packed" -C "$OUT" "${loose[@]#"$OUT"/}" && rm -rf "${loose[@]}" &&
    echo "== ${#loose[@]} files packed into $packed"
fi
exit $status
