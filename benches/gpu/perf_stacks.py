"""Aggregates `perf script` output of a profile_wave run (perf record -g): samples outside
the flush loop by phase (plan / execute / other), their leaf symbols, and each leaf with the
first attnstore frames above it. Usage: python3 perf_stacks.py STACKS.txt [plan,execute,other]
(see benches/gpu/perf-stage.sh and docs/bench.md, session 34). Stacks of rayon workers that
stole planning work land in "execute" (their frames name StackJob::execute), so read the
attnstore frames, not only the phase."""
import sys, collections
def frames_of(block):
    out = []
    for l in block.split('\n')[1:]:
        l = l.strip()
        if not l: continue
        parts = l.split(' ', 1)
        if len(parts) < 2: continue
        sym = parts[1].rsplit(' (', 1)[0]
        sym = sym.rsplit('+0x', 1)[0]
        out.append(sym)
    return out
blocks = open(sys.argv[1]).read().split('\n\n')
phase = collections.Counter(); leaf = {'plan': collections.Counter(), 'execute': collections.Counter(), 'other': collections.Counter()}
ours = {'plan': collections.Counter(), 'execute': collections.Counter(), 'other': collections.Counter()}
for b in blocks:
    f = frames_of(b)
    if not f or any('profile_wave::main' == x for x in f[:2]): continue
    j = ' '.join(f)
    p = 'plan' if ('plan_request' in j or 'Engine::plan' in j or 'plan_head' in j) else ('execute' if ('execute' in j) else 'other')
    phase[p] += 1
    leaf[p][f[0][:110]] += 1
    ats = [x for x in f if 'attnstore' in x][:3]
    ours[p][(f[0][:40] + '  <-  ' + ' <- '.join(a[:70] for a in ats))] += 1
tot = sum(phase.values())
print('samples outside the flush loop', tot, dict(phase))
import signal; signal.signal(signal.SIGPIPE, signal.SIG_DFL)
for p in sys.argv[2].split(',') if len(sys.argv) > 2 else ['plan', 'execute', 'other']:
    print('== leaf symbols,', p)
    for k, v in leaf[p].most_common(25): print(f'{v:6d} {100*v/max(1,phase[p]):5.1f}%  {k}')
    print('== leaf <- first attnstore frame,', p)
    for k, v in ours[p].most_common(25): print(f'{v:6d} {100*v/max(1,phase[p]):5.1f}%  {k}')
