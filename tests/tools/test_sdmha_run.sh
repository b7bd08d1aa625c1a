#!/usr/bin/env bash
# The sdmha-run tests (CTest label `tool`, registered in the CMakeLists.txt beside it), one CASE
# per call.
#
#   test_sdmha_run.sh CASE WORKDIR SDMHA_RUN COMPARE EDIT GOLDENS_DIR
#
# COMPARE and EDIT are the test-only programs sdmha_compare_safetensors and
# sdmha_edit_safetensors (C++, so that no Python or numpy is needed). Bad files are derived from
# the goldens at test time in WORKDIR, which each case empties first.
#
# A failing run must exit with the expected status, print exactly one line to stderr that starts
# with "sdmha-run: error: " and names the file (and the tensor where there is one), and leave no
# output file and no temporary file behind.
set -u

readonly SKIP=77  # CTest's SKIP_RETURN_CODE for the cases that need a zip program

if [[ $# -ne 6 ]]; then
  echo "usage: $0 CASE WORKDIR SDMHA_RUN COMPARE EDIT GOLDENS_DIR" >&2
  exit 2
fi
readonly CASE=$1 WORKDIR=$2 RUN=$3 COMPARE=$4 EDIT=$5 GOLDENS=$6
readonly OUT=$WORKDIR/out.safetensors

rm -rf "$WORKDIR" && mkdir -p "$WORKDIR" || exit 1
cd "$WORKDIR" || exit 1

failures=0
fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

golden() { echo "$GOLDENS/$1.safetensors"; }
# The cases of tests/data/semantics/ (tools/testdata/make_semantics_goldens.py), next to the goldens.
semantics() { echo "$GOLDENS/../semantics/$1.safetensors"; }
keras() { echo "$GOLDENS/../keras/$1"; }

# Runs sdmha-run with the given arguments; its stdout, stderr and status land in
# run.stdout, run.stderr and $status.
status=0
run() {
  echo "+ sdmha-run $*"
  "$RUN" "$@" >run.stdout 2>run.stderr
  status=$?
  sed 's/^/  stdout: /' run.stdout
  sed 's/^/  stderr: /' run.stderr
}

expect_success() {
  run "$@"
  [[ $status -eq 0 ]] || fail "exit status $status; expected 0"
}

# expect_error STATUS TEXT... -- ARGS...: the run fails with STATUS and its one-line message
# contains every TEXT (a file name, a tensor name, the problem).
expect_error() {
  local expected_status=$1
  shift
  local texts=()
  while [[ $# -gt 0 && $1 != "--" ]]; do
    texts+=("$1")
    shift
  done
  shift
  run "$@"
  [[ $status -eq $expected_status ]] || fail "exit status $status; expected $expected_status"
  local lines
  lines=$(wc -l <run.stderr)
  [[ $lines -eq 1 ]] || fail "stderr has $lines lines; expected exactly 1"
  grep -q '^sdmha-run: error: ' run.stderr || fail "stderr does not start with 'sdmha-run: error: '"
  local text
  for text in "${texts[@]}"; do
    grep -qF -- "$text" run.stderr || fail "the message does not mention '$text'"
  done
  [[ ! -s run.stdout ]] || fail "a failed run printed to stdout"
  expect_no_output
}

expect_no_output() {
  [[ ! -e $OUT ]] || fail "$OUT exists after a failed run"
  local leftovers
  leftovers=$(find "$WORKDIR" -name '*.tmp-*')
  [[ -z $leftovers ]] || fail "temporary files left behind: $leftovers"
}

# compare RESULT REFERENCE ARGS...: the compare program passes.
compare() {
  echo "+ compare $*"
  "$COMPARE" "$@" || fail "compare $* failed"
}

compare_with_golden() {
  compare "$OUT" "$(golden "$1")" output=expected/output attention_scores=expected/attention_scores
}

compare_with_semantics() {
  compare "$OUT" "$(semantics "$1")" output=expected/output attention_scores=expected/attention_scores
}

edit() {
  "$EDIT" "$@" || { echo "cannot prepare the test: edit $* failed" >&2; exit 1; }
}

# The little-endian 8-byte header length followed by TEXT, written to FILE.
write_safetensors_header() {
  local file=$1 text=$2 length=${#2} i escapes=""
  for ((i = 0; i < 8; ++i)); do
    escapes+=$(printf '\\0%03o' $(((length >> (8 * i)) & 255)))
  done
  printf '%b' "$escapes" >"$file"
  printf '%s' "$text" >>"$file"
}

# make_npz GOLDEN NPZ [EDITS...]: the golden's tensors (after EDITS) as an .npz archive.
make_npz() {
  local source=$1 archive=$2
  shift 2
  local directory
  directory=$WORKDIR/npz.$(basename "$archive")
  edit "$source" --npy-dir "$directory" "$@"
  if command -v zip >/dev/null; then
    (cd "$directory" && zip -q -r "$archive" .) || exit 1
  elif command -v python3 >/dev/null; then
    # Python's zipfile, as numpy.savez uses. (`cmake -E tar --format=zip` writes data
    # descriptors, which libzip's consistency check rejects.)
    (cd "$directory" && python3 -c '
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w") as archive:
    for root, _, files in os.walk("."):
        for name in files:
            path = os.path.join(root, name)
            archive.write(path, os.path.relpath(path, "."))
' "$archive") || exit 1
  else
    echo "SKIP: neither zip nor python3 is available to build an .npz" >&2
    exit $SKIP
  fi
}

case $CASE in
  golden:*)
    expect_success --weights "$(golden "${CASE#golden:}")" --inputs "$(golden "${CASE#golden:}")" \
      --out "$OUT" --scores --threads 2
    compare_with_golden "${CASE#golden:}"
    ;;
  regrouped:*)
    expect_success --weights "$(golden "${CASE#regrouped:}")" --inputs "$(golden "${CASE#regrouped:}")" \
      --out "$OUT" --scores --threads 2 --strategy sparse_regrouped
    compare_with_golden "${CASE#regrouped:}"
    ;;

  semantics:*)
    name=${CASE#semantics:}
    expect_success --weights "$(semantics "$name")" --inputs "$(semantics "$name")" \
      --out "$OUT" --scores --threads 2
    compare_with_semantics "$name"
    ;;
  semantics_regrouped:*)
    name=${CASE#semantics_regrouped:}
    expect_success --weights "$(semantics "$name")" --inputs "$(semantics "$name")" \
      --out "$OUT" --scores --threads 2 --strategy sparse_regrouped
    compare_with_semantics "$name"
    ;;

  bias_split_files)
    # Mask and bias in the inputs file; scale, fully_masked_rows and causal_alignment from the
    # weights file's metadata, over the inputs file's (which gets other values).
    for name in scale_keras_f64 fully_masked_mask_uniform_keras_f64; do
      edit "$(semantics $name)" --out weights.safetensors --drop query/indices --drop query/values \
        --drop query/dense_shape --drop key --drop value --drop attention_mask \
        --drop attention_bias --drop expected/output --drop expected/attention_scores
      edit "$(semantics $name)" --out inputs.safetensors --drop query/kernel --drop query/bias \
        --drop key/kernel --drop key/bias --drop value/kernel --drop value/bias \
        --drop attention_output/kernel --drop attention_output/bias \
        --metadata scale 99 --metadata fully_masked_rows zeros --metadata causal_alignment bottom_right
      # Without a scale in the weights file, the inputs file's applies (here the default's value).
      if [[ $name != scale_* ]]; then
        edit inputs.safetensors --out inputs.safetensors --metadata scale 0.5773502691896258
      fi
      expect_success --weights weights.safetensors --inputs inputs.safetensors --out "$OUT" --scores
      compare_with_semantics $name
      rm -f "$OUT"
    done
    # ... and another value changes the result.
    edit inputs.safetensors --out inputs.safetensors --metadata scale 2.5
    expect_success --weights weights.safetensors --inputs inputs.safetensors --out "$OUT"
    echo "+ compare (expected to differ with the inputs file's scale)"
    if "$COMPARE" "$OUT" "$(semantics fully_masked_mask_uniform_keras_f64)" \
        output=expected/output >/dev/null; then
      fail "the inputs file's scale was not read"
    fi
    ;;
  bias_npz_files)
    for name in mask_bhts_bias_ts_torch_f64 fully_masked_bias_uniform_keras_f64 \
        mask_b1ts_bias_bhts_keras_f32; do
      make_npz "$(semantics $name)" "$WORKDIR/$name.npz"
      expect_success --weights "$WORKDIR/$name.npz" --inputs "$WORKDIR/$name.npz" --out "$OUT" --scores
      compare_with_semantics $name
      rm -f "$OUT"
    done
    ;;
  mask_bias_ranks)
    # The same numbers stored with another rank broadcast the same way: (B, T, S) as
    # (B, 1, T, S), (T, S) as (1, T, S) and (1, 1, T, S).
    name=mask_bts_bias_bhts_keras_f64
    edit "$(semantics $name)" --out rank4.safetensors --reshape attention_mask 2,1,4,5
    expect_success --weights rank4.safetensors --inputs rank4.safetensors --out "$OUT" --scores
    compare_with_semantics $name
    rm -f "$OUT"
    name=mask_ts_bias_b1ts_keras_f64
    for shape in 1,4,5 1,1,4,5; do
      edit "$(semantics $name)" --out reshaped.safetensors --reshape attention_mask $shape \
        --reshape attention_bias 2,4,5
      expect_success --weights reshaped.safetensors --inputs reshaped.safetensors --out "$OUT" --scores
      compare_with_semantics $name
      rm -f "$OUT"
    done
    ;;

  split_files)
    # Weights and inputs in files of their own; the inputs file's metadata is ignored.
    name=keras_causal_f64
    edit "$(golden $name)" --out weights.safetensors --drop query/indices --drop query/values \
      --drop query/dense_shape --drop value --drop expected/output --drop expected/attention_scores
    edit "$(golden $name)" --out inputs.safetensors --drop query/kernel --drop query/bias \
      --drop key/kernel --drop key/bias --drop value/kernel --drop value/bias \
      --drop attention_output/kernel --drop attention_output/bias \
      --metadata num_heads 99 --metadata layout torch --metadata use_causal_mask false
    expect_success --weights weights.safetensors --inputs inputs.safetensors --out "$OUT" --scores
    compare_with_golden $name
    ;;
  npz_files)
    # Weights and inputs from .npz archives (metadata as __metadata__/<key> uint8 arrays).
    for name in torch_packed_f64 keras_medium_f32; do
      make_npz "$(golden $name)" "$WORKDIR/$name.npz"
      expect_success --weights "$WORKDIR/$name.npz" --inputs "$WORKDIR/$name.npz" --out "$OUT" --scores
      compare_with_golden $name
      rm -f "$OUT"
    done
    # Mixed: .npz weights, safetensors inputs.
    expect_success --weights "$WORKDIR/torch_packed_f64.npz" --inputs "$(golden torch_packed_f64)" \
      --out "$OUT" --scores
    compare_with_golden torch_packed_f64
    ;;
  no_scores)
    expect_success --weights "$(golden keras_mask_f64)" --inputs "$(golden keras_mask_f64)" --out "$OUT"
    compare "$OUT" "$(golden keras_mask_f64)" output=expected/output --absent attention_scores
    ;;
  threads_one)
    expect_success --weights "$(golden keras_medium_f32)" --inputs "$(golden keras_medium_f32)" \
      --out "$OUT" --scores --threads 1
    compare_with_golden keras_medium_f32
    ;;
  causal_flag)
    # --causal and --no-causal override the metadata.
    edit "$(golden keras_causal_f64)" --out not_causal.safetensors --metadata use_causal_mask false
    expect_success --weights not_causal.safetensors --inputs not_causal.safetensors --out "$OUT" \
      --scores --causal
    compare_with_golden keras_causal_f64
    rm -f "$OUT"
    expect_success --weights "$(golden keras_causal_f64)" --inputs "$(golden keras_causal_f64)" \
      --out "$OUT" --scores --no-causal
    echo "+ compare (expected to differ without the causal mask)"
    if "$COMPARE" "$OUT" "$(golden keras_causal_f64)" output=expected/output >/dev/null; then
      fail "--no-causal gave the causal result"
    fi
    ;;
  keras_files)
    # A Keras 3 file as --weights, by content: .keras, .weights.h5 (isolated, then in-process),
    # the layer by name; the inputs (and Keras' output) of the file's fixture.
    for weights in functional_bias.keras functional_bias.weights.h5; do
      for flags in "" "--trusted-file" "--layer attention" "--layer layers/multi_head_attention"; do
        # shellcheck disable=SC2086  # flags: zero, one or two words
        expect_success --weights "$(keras $weights)" --inputs "$(keras functional_bias.inputs.safetensors)" \
          --out "$OUT" $flags
        compare "$OUT" "$(keras functional_bias.inputs.safetensors)" output=expected/output
        rm -f "$OUT"
      done
    done
    cp "$(keras functional_bias.keras)" renamed.bin  # by content, not by name
    expect_success --weights renamed.bin --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    compare "$OUT" "$(keras functional_bias.inputs.safetensors)" output=expected/output
    ;;
  keras_damaged)
    # libhdf5 crashes on these (an address overwritten with all ones: SIGSEGV, and SIGABRT after
    # heap corruption); the isolated reader turns that into an error naming the file.
    for damaged in address_all_ones_120 address_all_ones_688; do
      expect_error 1 "$damaged.weights.h5" "isolated reader was killed by signal" -- \
        --weights "$(keras damaged/$damaged.weights.h5)" \
        --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    done
    # A NaN weight is refused, naming the tensor and entry, unless allowed.
    expect_error 1 "nan_query_kernel.weights.h5" "query kernel holds NaN at (0, 1)" -- \
      --weights "$(keras damaged/nan_query_kernel.weights.h5)" \
      --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    expect_success --weights "$(keras damaged/nan_query_kernel.weights.h5)" --allow-non-finite-weights \
      --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    rm -f "$OUT"
    expect_error 1 "bad_shape.keras" "query_dense" -- --weights "$(keras bad_shape.keras)" \
      --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    head -c 2000 "$(keras functional_bias.weights.h5)" >truncated.weights.h5
    expect_error 1 "truncated.weights.h5" -- --weights truncated.weights.h5 \
      --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    expect_error 1 "no_such_layer" -- --weights "$(keras functional_bias.keras)" \
      --layer no_such_layer --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    ;;
  usage_keras_options)
    expect_error 2 "--prefix" "Keras file" -- --weights "$(keras functional_bias.keras)" \
      --prefix x/ --inputs "$(keras functional_bias.inputs.safetensors)" --out "$OUT"
    expect_error 2 "--layer" "not one" -- --weights "$(golden keras_basic_f64)" --layer x \
      --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  help)
    run --help
    [[ $status -eq 0 ]] || fail "--help exited with $status"
    grep -q '^Usage: sdmha-run' run.stdout || fail "--help does not print the usage"
    [[ ! -s run.stderr ]] || fail "--help printed to stderr"
    ;;

  missing_file)
    expect_error 1 "absent.safetensors" -- --weights absent.safetensors \
      --inputs "$(golden keras_basic_f64)" --out "$OUT"
    # A newline in the name is escaped: the message stays on one line.
    expect_error 1 'absent\x0aname.safetensors' -- --weights $'absent\nname.safetensors' \
      --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  truncated_file)
    head -c 3000 "$(golden keras_basic_f64)" >truncated.safetensors
    expect_error 1 "truncated.safetensors" "data_offsets" -- --weights truncated.safetensors \
      --inputs truncated.safetensors --out "$OUT"
    ;;
  corrupt_header)
    # Not JSON, with a newline where the parser stops: the message must stay on one line.
    write_safetensors_header corrupt.safetensors $'{"value": {"dtype"\n: ]}  '
    expect_error 1 "corrupt.safetensors" "JSON" -- --weights "$(golden keras_basic_f64)" \
      --inputs corrupt.safetensors --out "$OUT"
    ;;
  huge_header_length)
    printf '\377\377\377\377\377\377\377\177{}' >huge.safetensors
    expect_error 1 "huge.safetensors" "header length" -- --weights huge.safetensors \
      --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  empty_file)
    : >empty.safetensors
    expect_error 1 "empty.safetensors" -- --weights "$(golden keras_basic_f64)" \
      --inputs empty.safetensors --out "$OUT"
    ;;
  missing_input_tensor)
    edit "$(golden keras_basic_f64)" --out no_value.safetensors --drop value
    expect_error 1 "no_value.safetensors" "'value'" "missing" -- --weights "$(golden keras_basic_f64)" \
      --inputs no_value.safetensors --out "$OUT"
    ;;
  missing_weight_tensor)
    edit "$(golden keras_basic_f64)" --out no_key_kernel.safetensors --drop key/kernel
    expect_error 1 "no_key_kernel.safetensors" "'key/kernel'" "missing" -- \
      --weights no_key_kernel.safetensors --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  index_out_of_range)
    # Entry 1's feature (flat element 5 of the (nnz, 3) indices) past Eq = 16.
    edit "$(golden keras_basic_f64)" --out bad_index.safetensors --set query/indices 5 99
    expect_error 1 "bad_index.safetensors" "query/indices" "feature = 99 is out of range" -- \
      --weights bad_index.safetensors --inputs bad_index.safetensors --out "$OUT"
    # A failed run leaves an existing output file as it was.
    echo "previous output" >"$OUT"
    run --weights bad_index.safetensors --inputs bad_index.safetensors --out "$OUT"
    [[ $status -eq 1 && $(cat "$OUT") == "previous output" ]] || fail "a failed run changed $OUT"
    ;;
  wrong_value_shape)
    # value (2, 7, 12) relabelled (2, 12, 7): width 7 where the value kernel takes 12.
    edit "$(golden keras_basic_f64)" --out bad_value.safetensors --reshape value 2,12,7
    expect_error 1 "bad_value.safetensors" "value has width 7" -- \
      --weights bad_value.safetensors --inputs bad_value.safetensors --out "$OUT"
    # value with another batch than the query's.
    edit "$(golden keras_basic_f64)" --out bad_batch.safetensors --reshape value 1,14,12
    expect_error 1 "bad_batch.safetensors" "'value'" "batch" -- \
      --weights bad_batch.safetensors --inputs bad_batch.safetensors --out "$OUT"
    ;;
  wrong_kernel_shape)
    edit "$(golden keras_basic_f64)" --out bad_kernel.safetensors --reshape key/kernel 12,4,2
    expect_error 1 "bad_kernel.safetensors" "'key/kernel'" "[12, 4, 2]" -- \
      --weights bad_kernel.safetensors --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  bad_metadata)
    edit "$(golden keras_basic_f64)" --out bad_metadata.safetensors --metadata num_heads two
    expect_error 1 "bad_metadata.safetensors" "num_heads" -- \
      --weights bad_metadata.safetensors --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  heads_disagree_with_metadata)
    edit "$(golden keras_basic_f64)" --out three_heads.safetensors --metadata num_heads 3
    expect_error 1 "three_heads.safetensors" "num_heads" -- \
      --weights three_heads.safetensors --inputs "$(golden keras_basic_f64)" --out "$OUT"
    # The same disagreement from the command line.
    expect_error 1 "keras_basic_f64.safetensors" "num_heads = 3" -- --num-heads 3 \
      --weights "$(golden keras_basic_f64)" --inputs "$(golden keras_basic_f64)" --out "$OUT"
    ;;
  bad_values_dtype)
    edit "$(golden keras_basic_f64)" --out int_values.safetensors --retype query/values I64
    expect_error 1 "int_values.safetensors" "'query/values'" "I64" -- \
      --weights "$(golden keras_basic_f64)" --inputs int_values.safetensors --out "$OUT"
    ;;
  huge_dense_shape)
    # Three numbers in the file ask for a (2, 10^9, 16) result; the run must refuse, not be killed.
    # The address-space limit makes sure of that even on a machine with the memory to try
    # (not under AddressSanitizer, whose shadow memory needs the address space).
    edit "$(golden keras_basic_f64)" --out huge_shape.safetensors --set query/dense_shape 1 1000000000
    grep -qa __asan_init "$RUN" || ulimit -v 8000000 2>/dev/null
    expect_error 1 "huge_shape.safetensors" "(2, 1000000000, 16)" "max_rows" "memory" -- \
      --weights huge_shape.safetensors --inputs huge_shape.safetensors --out "$OUT"
    ;;
  bad_mask_shape)
    # (B, T, S) = (2, 4, 5) relabelled (2, 5, 4): refused when the inputs are read.
    edit "$(semantics mask_bts_bias_bhts_keras_f64)" --out bad_mask.safetensors \
      --reshape attention_mask 2,5,4
    expect_error 1 "bad_mask.safetensors" "'attention_mask'" "[2, 5, 4]" "expected [2, 4, 5]" -- \
      --weights bad_mask.safetensors --inputs bad_mask.safetensors --out "$OUT"
    # Rank 5.
    edit "$(semantics mask_bts_bias_bhts_keras_f64)" --out rank5.safetensors \
      --reshape attention_mask 1,2,1,4,5
    expect_error 1 "rank5.safetensors" "'attention_mask'" "[1, 2, 1, 4, 5]" -- \
      --weights rank5.safetensors --inputs rank5.safetensors --out "$OUT"
    ;;
  bad_bias_shape)
    # A batch of 4 where the query's is 2 (neither B nor 1).
    edit "$(semantics bias_only_bhts_keras_f64)" --out bad_bias.safetensors \
      --reshape attention_bias 4,1,4,5
    expect_error 1 "bad_bias.safetensors" "'attention_bias'" "[4, 1, 4, 5]" -- \
      --weights bad_bias.safetensors --inputs bad_bias.safetensors --out "$OUT"
    ;;
  bad_mask_heads)
    # (B, H, T, S) = (2, 2, 4, 5) relabelled (1, 4, 4, 5): 4 heads where the layer has 2; only
    # the layer knows its heads, so the message names both files.
    edit "$(semantics mask_bhts_bias_ts_torch_f64)" --out heads.safetensors \
      --reshape attention_mask 1,4,4,5
    expect_error 1 "heads.safetensors" "attention_mask is (1, 4, 4, 5)" "(B, H, T, S) = (2, 2, 4, 5)" -- \
      --weights "$(semantics mask_bhts_bias_ts_torch_f64)" --inputs heads.safetensors --out "$OUT"
    ;;
  bad_bias_heads)
    edit "$(semantics bias_only_bhts_keras_f64)" --out heads.safetensors \
      --reshape attention_bias 1,4,4,5
    expect_error 1 "heads.safetensors" "attention_bias is (1, 4, 4, 5)" -- \
      --weights heads.safetensors --inputs heads.safetensors --out "$OUT"
    ;;
  bad_bias_dtype)
    edit "$(semantics bias_only_bhts_keras_f64)" --out int_bias.safetensors \
      --retype attention_bias I64
    expect_error 1 "int_bias.safetensors" "'attention_bias'" "I64" "expected F32 or F64" -- \
      --weights int_bias.safetensors --inputs int_bias.safetensors --out "$OUT"
    ;;
  bad_mask_dtype)
    # A mask byte that is neither 0 nor 1.
    edit "$(semantics mask_bts_bias_bhts_keras_f64)" --out byte_mask.safetensors \
      --retype attention_mask U8 --set attention_mask 3 7
    expect_error 1 "byte_mask.safetensors" "'attention_mask'" -- \
      --weights byte_mask.safetensors --inputs byte_mask.safetensors --out "$OUT"
    ;;
  npz_missing_tensor)
    make_npz "$(golden torch_packed_f64)" "$WORKDIR/no_value.npz" --drop value
    expect_error 1 "no_value.npz" "'value'" -- \
      --weights "$WORKDIR/no_value.npz" --inputs "$WORKDIR/no_value.npz" --out "$OUT"
    ;;
  unwritable_output)
    expect_error 1 "no/such/directory/out.safetensors" -- --weights "$(golden keras_basic_f64)" \
      --inputs "$(golden keras_basic_f64)" --out "$WORKDIR/no/such/directory/out.safetensors"
    ;;

  usage_unknown_flag)
    expect_error 2 "--bogus" -- --weights "$(golden keras_basic_f64)" \
      --inputs "$(golden keras_basic_f64)" --out "$OUT" --bogus
    ;;
  usage_missing_out)
    expect_error 2 "--out" -- --weights "$(golden keras_basic_f64)" --inputs "$(golden keras_basic_f64)"
    ;;
  usage_bad_threads)
    for threads in abc -1 2x 100000; do
      expect_error 2 "--threads" -- --weights "$(golden keras_basic_f64)" \
        --inputs "$(golden keras_basic_f64)" --out "$OUT" --threads "$threads"
    done
    expect_error 2 "--num-heads" -- --weights "$(golden keras_basic_f64)" \
      --inputs "$(golden keras_basic_f64)" --out "$OUT" --num-heads 0
    expect_error 2 "--layout" -- --weights "$(golden keras_basic_f64)" \
      --inputs "$(golden keras_basic_f64)" --out "$OUT" --layout jax
    ;;
  usage_npz_output)
    expect_error 2 "safetensors only" -- --weights "$(golden keras_basic_f64)" \
      --inputs "$(golden keras_basic_f64)" --out "$WORKDIR/out.npz"
    [[ ! -e $WORKDIR/out.npz ]] || fail "out.npz was written"
    ;;
  usage_out_is_input)
    cp "$(golden keras_basic_f64)" input.safetensors
    expect_error 2 "input.safetensors" -- --weights input.safetensors --inputs input.safetensors \
      --out "$WORKDIR/./input.safetensors"
    cmp -s input.safetensors "$(golden keras_basic_f64)" || fail "the input file was changed"
    ;;

  *)
    echo "unknown case '$CASE'" >&2
    exit 2
    ;;
esac

if [[ $failures -ne 0 ]]; then
  echo "$CASE: $failures check(s) failed" >&2
  exit 1
fi
echo "$CASE: pass"
