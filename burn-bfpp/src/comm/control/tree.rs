//! The shape of the control plane: the ranks of a world as a [`FAN_OUT`]-ary tree rooted at
//! rank 0 (rank `r`'s parent is `(r - 1) / FAN_OUT`, its children `FAN_OUT·r + 1 ..=
//! FAN_OUT·r + FAN_OUT`), so every rank holds at most `FAN_OUT + 1` connections whatever the
//! world size. A message between two ranks travels the unique tree path between them, which
//! keeps the messages of one sender to one receiver in order (every connection is FIFO and
//! every rank forwards what arrives on one connection in arrival order).

/// Children per rank. Four keeps a rank at five connections (ten I/O threads) and a world of
/// 1,024 ranks five levels deep, so a message crosses at most ten connections.
pub(super) const FAN_OUT: usize = 4;

/// One rank's place in the tree of a world of `size` ranks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tree {
    pub(super) rank: usize,
    pub(super) size: usize,
}

/// The parent of a rank other than 0.
fn parent_of(rank: usize) -> usize {
    (rank - 1) / FAN_OUT
}

/// Whether `a` is `b` or one of its ancestors (ancestors have smaller ranks).
fn is_ancestor_or_self(a: usize, mut b: usize) -> bool {
    while b > a {
        b = parent_of(b);
    }
    a == b
}

/// The lowest common ancestor of `a` and `b`.
fn common_ancestor(mut a: usize, mut b: usize) -> usize {
    while a != b {
        if a > b {
            a = parent_of(a);
        } else {
            b = parent_of(b);
        }
    }
    a
}

impl Tree {
    /// This rank's parent; `None` on rank 0.
    pub(super) fn parent(&self) -> Option<usize> {
        (self.rank > 0).then(|| parent_of(self.rank))
    }

    /// This rank's children.
    pub(super) fn children(&self) -> std::ops::Range<usize> {
        let first = (FAN_OUT * self.rank + 1).min(self.size);
        first..(first + FAN_OUT).min(self.size)
    }

    /// The neighbours (parent, then children) this rank connects to.
    pub(super) fn neighbours(&self) -> Vec<usize> {
        self.parent().into_iter().chain(self.children()).collect()
    }

    /// The neighbour a message for `dst` (not this rank) leaves through.
    pub(super) fn next_hop(&self, dst: usize) -> usize {
        if is_ancestor_or_self(self.rank, dst) {
            let mut hop = dst;
            while parent_of(hop) != self.rank {
                hop = parent_of(hop);
            }
            hop
        } else {
            parent_of(self.rank)
        }
    }

    /// Whether the path from this rank to `dst` passes through `via` (or ends at it): the
    /// ranks this one can no longer reach once `via` is gone.
    pub(super) fn reached_through(&self, via: usize, dst: usize) -> bool {
        let (x, n) = (self.rank, via);
        (is_ancestor_or_self(n, x) || is_ancestor_or_self(n, dst))
            && is_ancestor_or_self(common_ancestor(x, dst), n)
            && n != x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path between two ranks found by a breadth-first search over the edges, knowing
    /// nothing of the numbering's arithmetic.
    fn path(size: usize, from: usize, to: usize) -> Vec<usize> {
        let mut adjacent = vec![Vec::new(); size];
        for child in 1..size {
            let parent = (child - 1) / FAN_OUT;
            adjacent[parent].push(child);
            adjacent[child].push(parent);
        }
        let mut before = vec![usize::MAX; size];
        let mut queue = std::collections::VecDeque::from([from]);
        before[from] = from;
        while let Some(r) = queue.pop_front() {
            for &n in &adjacent[r] {
                if before[n] == usize::MAX {
                    before[n] = r;
                    queue.push_back(n);
                }
            }
        }
        let mut walk = vec![to];
        while *walk.last().expect("non-empty") != from {
            walk.push(before[*walk.last().expect("non-empty")]);
        }
        walk.reverse();
        walk
    }

    #[test]
    fn routes_and_cut_off_ranks_follow_the_tree_paths() {
        for size in [1, 2, 5, 6, 21, 22, 90] {
            for rank in 0..size {
                let tree = Tree { rank, size };
                let links = tree.neighbours();
                assert!(
                    links.len() <= FAN_OUT + 1,
                    "rank {rank} of {size}: {links:?}"
                );
                for dst in (0..size).filter(|&d| d != rank) {
                    let walk = path(size, rank, dst);
                    assert_eq!(tree.next_hop(dst), walk[1], "{rank} -> {dst} in {size}");
                    assert!(links.contains(&walk[1]));
                    for via in (0..size).filter(|&v| v != rank) {
                        assert_eq!(
                            tree.reached_through(via, dst),
                            walk.contains(&via),
                            "{rank} -> {dst} via {via} in {size}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_rank_but_the_root_is_the_child_of_its_parent() {
        let size = 300;
        let mut seen = vec![0; size];
        for rank in 0..size {
            let tree = Tree { rank, size };
            for child in tree.children() {
                seen[child] += 1;
                assert_eq!(Tree { rank: child, size }.parent(), Some(rank));
            }
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1..].iter().all(|&n| n == 1));
    }
}
