//! Putting a wave layer's meta index on the device: a clustered layer or the buffer
//! manager's arena layout uploaded, the steady zone written, the Gpu-tier slot table.

use super::*;

impl GpuBackend {
    /// Copies `layer`'s meta index to device memory.
    pub fn upload_wave(&self, layer: &ClusteredLayer) -> Result<DeviceWave> {
        if layer.head_dim != self.head_dim {
            return Err(Error::ShapeMismatch { what: "layer head_dim", expected: self.head_dim, got: layer.head_dim });
        }
        let sizes: Vec<u32> = (0..layer.kv_heads)
            .flat_map(|h| (0..layer.clusters).map(move |c| (h, c)))
            .map(|(h, c)| layer.size(h, c) as u32)
            .collect();
        let meta = MetaParts {
            centroids: &layer.centroids,
            value_means: &layer.value_means,
            sizes: &sizes,
            offsets: &layer.offsets,
        };
        let wave = self.upload_meta(meta, layer.kv_heads, layer.clusters, layer.indexed, layer.rows, None)?;
        self.settle()?;
        Ok(wave)
    }

    /// Copies an arena layer to device memory: its meta index and row map (or, for 2-bit
    /// rows, its value-block table), and room for `steady_capacity` steady-zone rows per head
    /// (written with [`GpuBackend::set_steady`]). Steps over it read indexed rows (value
    /// blocks) from the arena (head stride 0) and Gpu-tier hits from an [`ArenaCache`].
    pub fn upload_arena_wave(&self, layer: &ArenaWave, steady_capacity: usize) -> Result<DeviceWave> {
        if layer.head_dim != self.head_dim {
            return Err(Error::ShapeMismatch { what: "layer head_dim", expected: self.head_dim, got: layer.head_dim });
        }
        let rows = layer.indexed + steady_capacity;
        if steady_capacity == 0 || rows > i32::MAX as usize || steady_capacity * layer.kv_heads > i32::MAX as usize / 2
        {
            return Err(Error::InvalidArgument {
                what: "arena layer",
                message: format!("needs 1..2^30 steady rows and < 2^31 rows, got {steady_capacity} and {rows}"),
            });
        }
        let groups = match &layer.groups {
            Some(g) => Some(self.upload_groups(g, layer.kv_heads, layer.clusters)?),
            None => None,
        };
        // A 2-bit layer reads whole arena blocks of 2R f16 rows (its pages).
        let arena_rows = match &groups {
            Some(g) => g.table.pages_needed * (g.table.page_bytes / (2 * self.head_dim)),
            None => layer.arena_rows_needed(),
        };
        if arena_rows > i32::MAX as usize {
            return Err(Error::InvalidArgument {
                what: "arena layer",
                message: format!("arena row {arena_rows} ≥ 2^31"),
            });
        }
        let s = &self.stream;
        let row_map: Vec<i32> = layer.row_map.iter().map(|&r| r as i32).collect();
        let steady = steady_capacity * layer.kv_heads * self.head_dim;
        let alloc = |n: usize| s.alloc_zeros::<u16>(n).map_err(gpu_err("allocating the steady zone"));
        let stage = self.mailbox::<u16>(2 * steady)?;
        let mut marks = self.mailbox::<i32>(2)?;
        marks.as_mut().copy_from_slice(&[0, i32::MAX]);
        let arena = ArenaRows {
            row_map: s.clone_htod(&row_map).map_err(gpu_err("copying the row map"))?,
            keys: alloc(steady)?,
            values: alloc(steady)?,
            len: s.alloc_zeros::<i32>(1).map_err(gpu_err("allocating the steady zone"))?,
            stage,
            marks,
            stream: Arc::clone(&self.stream),
            capacity: steady_capacity,
            synced: 0,
            arena_rows,
        };
        let offsets = layer.offsets();
        let meta = MetaParts {
            centroids: &layer.centroids,
            value_means: &layer.value_means,
            sizes: &layer.sizes,
            offsets: &offsets,
        };
        let mut wave = self.upload_meta(meta, layer.kv_heads, layer.clusters, layer.indexed, rows, Some(arena))?;
        wave.groups = groups;
        self.settle()?;
        Ok(wave)
    }

    /// Writes steady-zone rows `from..from + n` of an arena layer (`keys`, `values`: f16 bits,
    /// `n × kv_heads × head_dim`, row-major over heads) and sets its length to `from + n`:
    /// `from` 0 rewrites the zone, `from` = [`DeviceWave::steady_rows`] appends. The rows go
    /// to the layer's mapped staging; the next step copies what changed to the device before
    /// it reads the zone. Call it only while no step over this layer is in flight (after its
    /// fetch).
    pub fn set_steady(&self, wave: &mut DeviceWave, from: usize, keys: &[u16], values: &[u16]) -> Result<()> {
        let per_row = wave.kv_heads * self.head_dim;
        let Some(a) = wave.arena.as_mut() else {
            return Err(Error::InvalidArgument {
                what: "steady rows",
                message: "the layer is not an arena layer".into(),
            });
        };
        let n = keys.len() / per_row;
        if keys.len() != n * per_row || values.len() != keys.len() || from > a.synced || from + n > a.capacity {
            return Err(Error::InvalidArgument {
                what: "steady rows",
                message: format!(
                    "rows {from}..{} of {per_row} values each (keys {}, values {}) must follow the {} written and fit {}",
                    from + n,
                    keys.len(),
                    values.len(),
                    a.synced,
                    a.capacity
                ),
            });
        }
        let span = from * per_row..(from + n) * per_row;
        let half = a.capacity * per_row;
        let stage = a.stage.as_mut();
        stage[span.clone()].copy_from_slice(keys);
        stage[half + span.start..half + span.end].copy_from_slice(values);
        // Rows first, then the marks (the next step reads the marks, then the rows).
        let marks = a.marks.as_mut();
        marks[1] = marks[1].min(from as i32);
        marks[0] = (from + n) as i32;
        a.synced = from + n;
        Ok(())
    }

    /// The meta index of a layer in device memory.
    fn upload_meta(
        &self,
        meta: MetaParts<'_>,
        kv_heads: usize,
        clusters: usize,
        indexed: usize,
        rows: usize,
        arena: Option<ArenaRows>,
    ) -> Result<DeviceWave> {
        if rows > i32::MAX as usize || clusters == 0 {
            return Err(Error::InvalidArgument {
                what: "layer",
                message: format!("needs 1..2^31 clusters and rows, got {clusters} and {rows}"),
            });
        }
        let bits = |x: &[half::f16]| x.iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        let cent = self.upload_centroids(&bits(meta.centroids), kv_heads)?;
        let s = &self.stream;
        let log_size: Vec<f32> =
            meta.sizes.iter().map(|&n| if n == 0 { f32::NEG_INFINITY } else { (n as f32).ln() }).collect();
        let offsets: Vec<i32> = meta.offsets.iter().map(|&o| o as i32).collect();
        Ok(DeviceWave {
            cent,
            value_means: s.clone_htod(&bits(meta.value_means)).map_err(gpu_err("copying mean values"))?,
            log_size: s.clone_htod(&log_size).map_err(gpu_err("copying cluster sizes"))?,
            offsets: s.clone_htod(&offsets).map_err(gpu_err("copying cluster offsets"))?,
            kv_heads,
            clusters,
            indexed,
            rows,
            largest: meta.sizes.iter().copied().max().unwrap_or(0) as usize,
            arena,
            groups: None,
        })
    }

    /// An empty table of `block_rows`-row blocks over `wave`'s rows (nothing cached).
    pub fn wave_table(&self, wave: &DeviceWave, block_rows: usize) -> Result<WaveTable> {
        if block_rows == 0 {
            return Err(Error::InvalidArgument { what: "block_rows", message: "must be positive".into() });
        }
        let blocks_per_head = wave.rows.div_ceil(block_rows);
        let host = vec![-1i32; wave.kv_heads * blocks_per_head];
        let dev = self.stream.clone_htod(&host).map_err(gpu_err("copying the wave table"))?;
        Ok(WaveTable { host, dev, block_rows, blocks_per_head, kv_heads: wave.kv_heads, needs: 0 })
    }

    /// Enqueues a copy of the table's host side to the device (the next launch sees it).
    pub fn upload_table(&self, table: &mut WaveTable) -> Result<()> {
        self.stream.memcpy_htod(&table.host, &mut table.dev).map_err(gpu_err("copying the wave table"))
    }
}
